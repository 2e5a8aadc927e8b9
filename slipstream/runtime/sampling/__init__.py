"""Sampling on the device: the kernels (sampler.py), the per-row parameter columns (sampling_args.py),
their launch behind a step's forward (sampling_launch.py), and logits processors (logits_process.py)."""

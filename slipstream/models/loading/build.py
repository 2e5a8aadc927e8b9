"""Build a ready model + tokenizer from a model spec: the registry's family for the spec builds it
(models/registry.py; the Llama family's builds are models/llama/build.py)."""
from __future__ import annotations

import torch

from slipstream.models import registry
from slipstream.models.base import BuildOptions, Model


def build_model(spec: str, dtype: str, device: torch.device, seed: int = 0, pack: bool = False,
                weights: str = "dequantized", invariant: bool = False):
    """Returns (model, tokenizer, ModelConfig) (BuildOptions says what the options do)."""
    options = BuildOptions(dtype=dtype, device=device, seed=seed, pack=pack, weights=weights, invariant=invariant)
    return registry.for_spec(spec).build(spec, options)


def cpu_backend_available(model: Model) -> bool:
    """Whether `model` can move to the "cpu" kernel backend (models/llama/forward_cpu.py): a family
    that offers it, a model still on the reference backend, and the compiled kernels loaded."""
    from slipstream.models.kernels.cpu_kernels import native_kernels

    return "cpu" in model.backends and model.backend == "reference" and native_kernels() is not None

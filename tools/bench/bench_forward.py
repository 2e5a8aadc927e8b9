"""Decode forward time of the default model on CPU at batch 1, 8 and 32 (median of repeats).

Each sequence has a context of --context tokens in the paged KV cache; one decode step runs one
token per sequence through the model (no sampling, no scheduler). Prints a markdown table.

    python tools/bench/bench_forward.py [--model smollm2-135m] [--batches 1 8 32] [--repeats 10] [--threads N]

Variants, interleaved per batch size: the default (the GGUF's weights kept quantized, the "cpu" kernel
backend: compiled kernels, models/llama/forward_cpu.py), and the dequantized float32 model on the reference
backend three ways: batch-invariant (what EngineConfig(batch_invariant=True) runs), dense without
padding, and oneDNN-packed projections (the dequantized mode's default before issue 39), and packed
on the cpu backend (what `--weights dequantized` runs now). For a model that is not a GGUF (random
weights) the quantized variant is left out. `--threads` sets torch's intra-op threads (run it at 1
and 2: the engine measures its own choice at start, runtime/devices/cpu_threads.py).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import os as _os
import sys as _sys

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))
_sys.path[:0] = [_ROOT, _os.path.join(_ROOT, "tools", "common")]  # this checkout, the shared helpers

from slipstream.runtime.devices.cpu_invariance import row_multiple_for  # noqa: E402
from slipstream.models.loading.build import build_model  # noqa: E402
from slipstream.models.base import KVCache  # noqa: E402
from host_batch import Chunk, host_batch  # noqa: E402


def forward_ms(model, config, batch: int, context: int, repeats: int, warmup: int, row_multiple: int) -> list[float]:
    page = 16
    pages_per_seq = -(-(context + 1) // page)
    kv = KVCache(config, 1 + batch * pages_per_seq, page, torch.float32, "cpu")
    kv.k.normal_()  # the pool is uninitialised; the bench reads contexts it never wrote
    kv.v.normal_()
    works = [Chunk(tokens=[100 + i], start_pos=context,
                   pages=list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)))
             for i in range(batch)]
    fb, _ = host_batch(works, page, row_multiple)
    times = []
    for i in range(warmup + repeats):
        fb.attn.cpu_plan = None  # the engine builds fresh metadata every step: so does each repeat
        t0 = time.perf_counter()
        model(fb, kv)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


VARIANTS = {  # label -> (model: weights mode + packed, kernel backend, invariant: fp64 attention + padded rows)
    "quantized, cpu backend: the default": (("quantized", False), "cpu", False),
    "dequantized, batch-invariant (dense, fp64 attention, rows padded)": (("dequantized", False), "reference", True),
    "dequantized, dense fp32, reference": (("dequantized", False), "reference", False),
    "dequantized, packed (oneDNN), reference": (("dequantized", True), "reference", False),
    "dequantized, packed (oneDNN), cpu backend": (("dequantized", True), "cpu", False),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    args = ap.parse_args()
    from slipstream.provenance import header, provenance  # noqa: E402

    if args.threads:
        torch.set_num_threads(args.threads)
    print(header(provenance()), flush=True)
    from slipstream.models.llama.build import quantized_source

    keys = {k for k, _, _ in VARIANTS.values()}
    if not quantized_source(args.model, torch.device("cpu")):
        keys.discard(("quantized", False))
    models = {k: build_model(args.model, "float32", torch.device("cpu"), pack=k[1], weights=k[0])[0] for k in keys}
    config = next(iter(models.values())).config
    print(f"model={args.model} torch={torch.__version__} threads={torch.get_num_threads()} context={args.context}")
    print("| batch | variant | forward median (ms) | mean | p90 | min | max | ms / token |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for b in args.batches:  # variants interleaved per batch size: a load change hits all of them alike
        for label, (key, backend, invariant) in VARIANTS.items():
            if key not in models:
                continue
            model = models[key]
            model.set_kernel_backend(backend)
            model.set_attention_dtype(torch.float64 if invariant else None)
            t = forward_ms(model, config, b, args.context, args.repeats, args.warmup,
                           row_multiple_for(config) if invariant else 1)
            med, p90 = statistics.median(t), statistics.quantiles(t, n=10, method="inclusive")[8]
            print(f"| {b} | {label} | {med:.1f} | {statistics.fmean(t):.1f} | {p90:.1f} | {min(t):.1f} | "
                  f"{max(t):.1f} | {med / b:.2f} |", flush=True)
            model.set_attention_dtype(None)


if __name__ == "__main__":
    main()

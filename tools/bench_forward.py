"""Decode forward time of the default model on CPU at batch 1, 8 and 32 (median of repeats).

Each sequence has a context of --context tokens in the paged KV cache; one decode step runs one
token per sequence through the model (no sampling, no scheduler). Prints a markdown table.

    python tools/bench_forward.py [--model smollm2-135m] [--batches 1 8 32] [--repeats 10]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))  # this checkout

from slipstream.runtime.cpu_invariance import row_multiple_for  # noqa: E402
from slipstream.models.attention import AttentionMetadata  # noqa: E402
from slipstream.models.build import build_model  # noqa: E402
from slipstream.models.llama import ForwardBatch, KVCache  # noqa: E402
from slipstream.models.host_batch import Chunk, host_batch  # noqa: E402


def forward_ms(model, config, batch: int, context: int, repeats: int, warmup: int, row_multiple: int) -> list[float]:
    page = 16
    pages_per_seq = -(-(context + 1) // page)
    kv = KVCache(config, 1 + batch * pages_per_seq, page, next(model.parameters()).dtype, "cpu")
    works = [Chunk(tokens=[100 + i], start_pos=context,
                   pages=list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)))
             for i in range(batch)]
    fb, _ = host_batch(works, page, row_multiple)
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        model(fb, kv)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    from slipstream.provenance import header, provenance  # noqa: E402

    print(header(provenance()), flush=True)
    model, _, config = build_model(args.model, "float32", torch.device("cpu"))
    print(f"model={args.model} torch={torch.__version__} threads={torch.get_num_threads()} context={args.context}")
    print("| batch | attention | forward median (ms) | min | max | ms / token |")
    print("|---:|---|---:|---:|---:|---:|")
    for invariant in (True, False):
        model.set_attention_dtype(torch.float64 if invariant else None)
        label = "fp64 attention, rows padded (engine default)" if invariant else "fp32, unpadded"
        for b in args.batches:
            t = forward_ms(model, config, b, args.context, args.repeats, args.warmup,
                           row_multiple_for(config) if invariant else 1)
            med = statistics.median(t)
            print(f"| {b} | {label} | {med:.1f} | {min(t):.1f} | {max(t):.1f} | {med / b:.2f} |")


if __name__ == "__main__":
    main()

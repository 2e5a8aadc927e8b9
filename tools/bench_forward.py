"""Decode forward time of the default model on CPU at batch 1, 8 and 32 (median of repeats).

Each sequence has a context of --context tokens in the paged KV cache; one decode step runs one
token per sequence through the model (no sampling, no scheduler). Prints a markdown table.

    python tools/bench_forward.py [--model smollm2-135m] [--batches 1 8 32] [--repeats 10] [--threads N]

Three variants, interleaved per batch size: batch-invariant (what EngineConfig(batch_invariant=True)
runs), dense float32 without padding, and the default (oneDNN-packed projections, batched decode
attention).
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
from slipstream.models.build import build_model  # noqa: E402
from slipstream.models.llama import KVCache  # noqa: E402
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


VARIANTS = {  # label -> (packed projections, invariant: fp64 attention + padded rows)
    "batch-invariant (dense, fp64 attention, rows padded)": (False, True),
    "dense fp32, unpadded": (False, False),
    "packed (oneDNN) fp32, unpadded: the default": (True, False),
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
    models = {packed: build_model(args.model, "float32", torch.device("cpu"), pack=packed) for packed in (False, True)}
    config = models[False][2]
    print(f"model={args.model} torch={torch.__version__} threads={torch.get_num_threads()} context={args.context}")
    print("| batch | variant | forward median (ms) | mean | p90 | min | max | ms / token |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for b in args.batches:  # variants interleaved per batch size: a load change hits all of them alike
        for label, (packed, invariant) in VARIANTS.items():
            model = models[packed][0]
            model.set_attention_dtype(torch.float64 if invariant else None)
            t = forward_ms(model, config, b, args.context, args.repeats, args.warmup,
                           row_multiple_for(config) if invariant else 1)
            med, p90 = statistics.median(t), statistics.quantiles(t, n=10, method="inclusive")[8]
            print(f"| {b} | {label} | {med:.1f} | {statistics.fmean(t):.1f} | {p90:.1f} | {min(t):.1f} | "
                  f"{max(t):.1f} | {med / b:.2f} |", flush=True)
        models[False][0].set_attention_dtype(None)


if __name__ == "__main__":
    main()

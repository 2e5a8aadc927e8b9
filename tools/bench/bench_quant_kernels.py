"""The CPU's quantized matmul against the alternatives, on the default model's layer shapes, one thread.

    python tools/bench_quant_kernels.py [--repeats 9] [--out docs/results/quant-2026-11-27/kernels_cpu.md]

One "pass" multiplies x [M, K] by all 210 projection matrices of SmolLM2-135M (30 layers x q, k, v, o,
gate, up, down; random weights), as a decode step streams them: 66 MB in Q4_1, more than the
machine's L3. Variants, interleaved per M: this project's kernel on Q4_1 (`cpu_matmul`), the same on
one layer's 7 matrices passed 30 times (the weights stay in cache: the kernel's arithmetic alone),
torch's packed int4 kernel (`_weight_int4pack_mm_for_cpu`, groups of 32, bf16 activations: its fast
case), and oneDNN with prepacked float32 and bf16 weights (`torch.ops.mkldnn._linear_pointwise`).
Thread CPU time per pass (time.thread_time), median of --repeats after 2 warm-ups.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tools"), str(ROOT)]

H, I, LAYERS = 576, 1536, 30
SHAPES = [(H, H), (192, H), (192, H), (H, H), (I, H), (I, H), (H, I)]


def q41(n: int, k: int, rng):
    from slipstream.models.kernels.quant_formats import repack

    raw = rng.integers(0, 256, (n, k // 32, 20), dtype=np.uint8)
    raw[..., 0:2] = np.array([0.01], np.float16).view(np.uint8)
    raw[..., 2:4] = np.array([-0.05], np.float16).view(np.uint8)
    return repack("Q4_1", raw.reshape(n, -1), k)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    from bench_lines import emit, pct, report

    from slipstream.models.kernels.cpu_kernels import native_kernels
    from slipstream.models.kernels.quant_linear import cpu_matmul

    torch.set_num_threads(1)
    lib = native_kernels()
    rng = np.random.default_rng(0)
    quant = [(k, q41(n, k, rng)) for _ in range(LAYERS) for n, k in SHAPES]
    hot = quant[:len(SHAPES)] * LAYERS
    int4 = [(k, torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1),
             (torch.rand(k // 32, n, 2) * 0.01).bfloat16()) for _ in range(LAYERS) for n, k in SHAPES]
    dnn32 = [(k, torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k) * 0.02, None))
             for _ in range(LAYERS) for n, k in SHAPES]
    dnn16 = [(k, torch.ops.mkldnn._reorder_linear_weight((torch.randn(n, k) * 0.02).bfloat16(), None))
             for _ in range(LAYERS) for n, k in SHAPES]

    def passes(m: int) -> dict:
        x32 = {H: torch.randn(m, H), I: torch.randn(m, I)}
        x16 = {k: v.bfloat16() for k, v in x32.items()}
        dnn = torch.ops.mkldnn._linear_pointwise
        return {
            "this project, Q4_1 (streamed from memory)": lambda: [cpu_matmul(x32[k], w, False, lib) for k, w in quant],
            "this project, Q4_1 (one layer's weights, in cache)": lambda: [cpu_matmul(x32[k], w, False, lib)
                                                                           for k, w in hot],
            "torch int4pack (bf16 activations)": lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(x16[k], w, 32, sz)
                                                          for k, w, sz in int4],
            "oneDNN packed float32": lambda: [dnn(x32[k], w, None, "none", [], "") for k, w in dnn32],
            "oneDNN packed bf16": lambda: [dnn(x16[k], w, None, "none", [], "") for k, w in dnn16],
        }

    def body() -> list[str]:
        lines: list[str] = []
        emit(lines, "210 projections of SmolLM2-135M per pass, 1 thread, thread CPU ms per pass (median of "
                    f"{args.repeats})\n")
        emit(lines, "| M | variant | median ms | mean | p90 | min | weights MB / pass |")
        emit(lines, "|---:|---|---:|---:|---:|---:|---:|")
        mb = {"this project, Q4_1 (streamed from memory)": sum(w.nbytes() for _, w in quant) / 1e6,
              "oneDNN packed float32": sum(n * k * 4 for _ in range(LAYERS) for n, k in SHAPES) / 1e6}
        for m in (1, 8, 32):
            variants = passes(m)
            times = {name: [] for name in variants}
            for rep in range(args.repeats + 2):
                for name, fn in variants.items():
                    t0 = time.thread_time()
                    fn()
                    if rep >= 2:
                        times[name].append((time.thread_time() - t0) * 1e3)
            for name, ts in times.items():
                emit(lines, f"| {m} | {name} | {statistics.median(ts):.2f} | {statistics.fmean(ts):.2f} | "
                            f"{pct(ts, 0.9):.2f} | {min(ts):.2f} | {mb.get(name, float('nan')):.0f} |")
        return lines

    report(body, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

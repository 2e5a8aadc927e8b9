"""Quantized weights on CUDA: the Triton quantized matmul against the bf16 path, then whole engines.

    python tools/gpu/bench_quant_gpu.py [--out quant_gpu.md]      (on a GPU machine)

1. Kernels: x [M, K] bf16 times each weight shape of SmolLM2-135M (the projections and the lm_head),
   M = 1, 8, 32: `quant_matmul_triton` on Q4_1 and Q8_0 weights (the default model's formats) against
   F.linear on the same weights dequantized to bf16 (cuBLAS). CUDA-event time per call, median of 100
   after 20 warm-ups (profile_forward_cuda.event_ms), and the bytes of weights read per microsecond.
2. Engines: random-smollm2-135m written as a Q4_1 GGUF (tools/peers/random_gguf.py --dtype q4_1: the default
   model's formats and shapes, random weights), EngineConfig(device="cuda", dtype="bfloat16") with
   weights "quantized" and "dequantized", CUDA graphs on (decode buckets 1, 16, 32; no mixed graphs),
   N streams of --gen greedy tokens (ignore_eos): decode tokens/s, as in tools/peers/bench_quant_peer.py.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# this room (profile_forward_cuda), tools/peers (random_gguf), tools/common, this checkout
sys.path[:0] = [str(ROOT / "tools" / "gpu"), str(ROOT / "tools" / "peers"), str(ROOT / "tools" / "common"), str(ROOT)]

SHAPES = {"q_proj / o_proj": (576, 576), "k_proj / v_proj": (192, 576), "gate / up": (1536, 576),
          "down": (576, 1536), "lm_head": (49152, 576)}


def cuda_ms(fn) -> float:
    from profile_forward_cuda import event_ms  # CUDA-event median, as the other GPU tools time

    return event_ms(fn, repeats=100, warmup=20)


def kernels(lines, emit) -> None:
    import gguf
    import numpy as np
    import torch
    import torch.nn.functional as F

    from slipstream.models.kernels.quant_formats import repack
    from slipstream.models.kernels.quant_triton import quant_matmul_triton

    emit(lines, "| weight | format | M | quantized (Triton) µs | bf16 (cuBLAS) µs | ratio | quantized GB/s | bf16 GB/s |")
    emit(lines, "|---|---|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for label, (n, k) in SHAPES.items():
        dense = rng.standard_normal((n, k)).astype(np.float32) * 0.02
        for fmt in ("Q4_1", "Q8_0"):
            raw = gguf.quants.quantize(dense, gguf.GGMLQuantizationType[fmt])
            w = repack(fmt, raw, k).map(lambda t: t.cuda())
            wb = w.dequantize(torch.bfloat16)
            for m in (1, 8, 32):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                tq = cuda_ms(lambda: quant_matmul_triton(x, w)) * 1e3
                tb = cuda_ms(lambda: F.linear(x, wb)) * 1e3
                emit(lines, f"| {label} {n}x{k} | {fmt} | {m} | {tq:.1f} | {tb:.1f} | {tq / tb:.2f} | "
                            f"{w.nbytes() / tq / 1e3:.0f} | {wb.numel() * 2 / tb / 1e3:.0f} |")


async def engine_rate(path: str, weights: str, n: int, gen: int) -> tuple[float, float]:
    from slipstream import Engine, EngineConfig, SamplingParams

    # a fixed KV pool (not sized from free memory: what the GPU reports free is shared with other tenants)
    cfg = EngineConfig(model=path, device="cuda", dtype="bfloat16", weights=weights, max_batch_size=32,
                       graph_batch_sizes=(1, 16, 32), mixed_graphs=False, kv_cache_tokens=16384, max_model_len=1024)
    t0 = time.perf_counter()
    async with Engine(cfg) as engine:
        start = time.perf_counter() - t0
        params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
        prompts = [[5 + i, 17, 33 + i, 9, 100 + i] * 4 for i in range(n)]

        async def one(p, stamps):
            async for _ in engine.stream(p, params):
                stamps.append(time.perf_counter())

        await asyncio.gather(*(one(p, []) for p in prompts[:2]))  # warm-up
        stamps = [[] for _ in prompts]
        await asyncio.gather(*(one(p, s) for p, s in zip(prompts, stamps)))
    first = max(s[0] for s in stamps)
    end = max(s[-1] for s in stamps)
    decoded = sum(sum(1 for t in s if t > first) for s in stamps)
    return decoded / (end - first), start


def engines(lines, emit, gen: int) -> None:
    from random_gguf import write

    path = os.path.join(tempfile.mkdtemp(), "random-smollm2-135m-q4_1.gguf")
    t0 = time.perf_counter()
    write("random-smollm2-135m", "q4_1", path)
    emit(lines, f"\nrandom-smollm2-135m as Q4_1 GGUF written in {time.perf_counter() - t0:.1f} s\n")
    emit(lines, "| N | weights | decode tok/s | engine start s |")
    emit(lines, "|---:|---|---:|---:|")
    for n in (1, 32):
        for weights in ("quantized", "dequantized", "quantized"):
            rate, start = asyncio.run(engine_rate(path, weights, n, gen))
            emit(lines, f"| {n} | {weights} | {rate:.1f} | {start:.1f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--skip-engines", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_quant_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    from bench_lines import emit, report

    def body() -> list[str]:
        lines: list[str] = []
        emit(lines, f"GPU: {torch.cuda.get_device_name()}\n")
        kernels(lines, emit)
        if not args.skip_engines:
            engines(lines, emit, args.gen)
        return lines

    report(body, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a decode step's GPU time goes: graph replay vs eager forward, kernels per step, top kernels.

    python tools/profile_forward_cuda.py [--model random-smollm2-135m] [--dtype bfloat16] [--batches 1 32 128 256]
                                         [--variants before fused-decode fused no-mlp-gemm unfused]

Builds an Engine on the GPU, takes its model runner, and for each batch size stages one decode step
(every sequence with --context tokens of random KV) into slot 0's arena. Times the captured graph's
replay and the eager forward with CUDA events (medians of --repeats after warm-up), then profiles one
eager forward with torch.profiler: number of kernels and the kernels with the most GPU time.

`--variants` runs the same table for several settings of the triton backend's fusions
(slipstream/models/llama/forward_triton.py TritonOptions), one Engine each, so they compare in one run:
`fused-decode` (the 5-launch decode layer up to fused_decode_max_rows = 16 rows, the 8-launch
layer above), `fused-decode-256` (the 5-launch layer up to 256 rows), `fused` (the default: the
8-launch layer at every batch), `no-mlp-gemm` (that, with gate-up on cuBLAS + the SiLU·up kernel), `unfused`
(separate q/k/v and gate/up matmuls as well), `before` (main before issue 42: the 8-launch layer with
the per-head attention kernel, attention_per_head_triton.py), so one run shows before and after.

`--launch both` (default) also times the eager forward with the thin launcher
(slipstream/models/kernels/triton_launch.py) right after Triton's own, on the same step: the
"eager thin ms" column; `--launch triton` leaves it out.
"""
from __future__ import annotations

import argparse
import functools
import asyncio
import statistics
import sys

import numpy as np
import torch

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__))))  # this checkout

from slipstream import Engine, EngineConfig  # noqa: E402
from slipstream.models.kernels import attention_triton  # noqa: E402
from slipstream.models.kernels import triton_launch  # noqa: E402
from slipstream.models.llama import forward_triton as llama_triton  # noqa: E402
from slipstream.runtime.batch import pack_step  # noqa: E402


def event_ms(fn, repeats: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_profile(fn, top: int) -> tuple[int, float, list[tuple[str, float, int]]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    ranked = sorted(((n[:70], sum(t) / 1e3, len(t)) for n, t in by_name.items()), key=lambda r: -r[1])
    return len(kernels), sum(e.device_time for e in kernels) / 1e3, ranked[:top]


VARIANTS = {
    "fused-decode": llama_triton.TritonOptions(fused_decode_max_rows=16),  # the 5-launch layer up to 16 rows
    "fused-decode-256": llama_triton.TritonOptions(fused_decode_max_rows=256),  # where does it stop paying?
    "fused": llama_triton.TritonOptions(),  # the default: the 8-launch layer at every batch
    "no-mlp-gemm": llama_triton.TritonOptions(mlp_gemm_max_rows=0, fused_decode_max_rows=0),
    "unfused": llama_triton.TritonOptions(fuse_projections=False, mlp_gemm_max_rows=0, fused_decode_max_rows=0),
    # main before issue 42 (5a54f2e): the 8-launch layer and the per-head attention kernel
    "before": llama_triton.TritonOptions(fused_decode_max_rows=0),
}
ATTENTION_IMPL = {"before": "per_head"}  # the others: paged_attention_triton's default (grouped)


async def main_async(args) -> None:
    for variant in args.variants:
        llama_triton.TRITON_DEFAULTS = VARIANTS[variant]  # what the engine's set_kernel_backend applies
        impl = ATTENTION_IMPL.get(variant, "grouped")
        # forward_triton looks the kernel up by its module-level name at every call
        llama_triton.paged_attention_triton = functools.partial(attention_triton.paged_attention_triton, impl=impl)
        print(f"\n## variant `{variant}`: {VARIANTS[variant]}, attention impl={impl}\n")
        await profile_variant(args)


def copy_bandwidth() -> float:
    """Bytes per second this GPU moves in a large device-to-device copy (each byte read and written)."""
    x = torch.empty(256 * 2**20, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    ms = event_ms(lambda: y.copy_(x), 20)
    return 2 * x.numel() * x.element_size() / (ms / 1e3)


def step_bytes(runner, n: int, context: int) -> int:
    """What a decode step must read at least: every weight once, and each sequence's K and V."""
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in runner.model.parameters()}.values())
    k = runner.kv.k
    per_token = 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()  # K and V, every layer
    return weights + n * (context + 1) * per_token


async def profile_variant(args) -> None:
    top = max(args.batches)
    cfg = EngineConfig(model=args.model, device="cuda", dtype=args.dtype, max_batch_size=top,
                       kv_cache_tokens=top * (args.context + 32), max_num_batched_tokens=max(512, top))
    async with Engine(cfg) as engine:
        runner = engine._parts.runner
        kv, compute = runner.kv, runner.device.compute.stream
        kv.k.normal_()
        kv.v.normal_()
        runner.rows.last_token.random_(3, 1000)
        pages = -(-(args.context + 1) // kv.page_size)
        print(f"{args.model} ({args.dtype}) on {torch.cuda.get_device_name()}, context {args.context}, "
              f"torch {torch.__version__}\n")
        bandwidth = copy_bandwidth()
        print(f"floor: bytes a step must read (weights once + K/V of every sequence) ÷ the measured copy bandwidth "
              f"({bandwidth / 1e12:.2f} TB/s)\n")
        print("| batch | graph replay ms | floor ms | replay ÷ floor | eager forward ms | eager ÷ graph "
              "| eager thin ms | thin ÷ eager | kernels/step | kernel time ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        details = []
        for n in args.batches:
            rows = torch.arange(1, n + 1, device=kv.k.device)
            runner.rows.pages[1:n + 1, :pages] = (1 + pages * (rows[:, None] - 1)
                                                  + torch.arange(pages, device=rows.device)[None, :])
            packed = pack_step(np.arange(1, n + 1), [])
            arena = runner.arenas[0]
            layout = arena.fill(packed)
            arena.upload()
            tensors = arena.tensors(layout)

            def reset_positions() -> None:  # each forward advances them: hold every row at the context
                runner.rows.pos[1:n + 1] = args.context

            with torch.cuda.stream(compute):
                eager = lambda: reset_positions() or runner.forward_from(tensors)  # noqa: E731
                eager_ms = event_ms(eager, args.repeats)
                thin_ms = float("nan")
                if args.launch == "both":
                    triton_launch.set_enabled(True)
                    try:
                        thin_ms = event_ms(eager, args.repeats)
                    finally:
                        triton_launch.set_enabled(False)
                count, busy, ranked = kernel_profile(eager, args.top)
                found = runner.graphs.lookup(0, n) if runner.graphs is not None else None
                graph_ms = float("nan")
                if found is not None:
                    bucket, graph = found
                    arena.fill(packed, pad_decode=bucket)
                    arena.upload()
                    graph_ms = event_ms(lambda: reset_positions() or graph.replay(), args.repeats)
            floor_ms = step_bytes(runner, n, args.context) / bandwidth * 1e3
            print(f"| {n} | {graph_ms:.3f} | {floor_ms:.3f} | {graph_ms / floor_ms:.1f} | {eager_ms:.3f} | "
                  f"{eager_ms / graph_ms:.2f} | {thin_ms:.3f} | {thin_ms / eager_ms:.2f} | {count} | {busy:.3f} |")
            details.append((n, ranked))
        for n, ranked in details:
            print(f"\nbatch {n}: kernels with the most GPU time (eager forward)\n\n| kernel | ms | launches |\n|---|---:|---:|")
            for name, ms, calls in ranked:
                print(f"| `{name}` | {ms:.3f} | {calls} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random-smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=["fused"])
    ap.add_argument("--launch", choices=("triton", "both"), default="both",
                    help="both: also time the eager forward with the thin launcher")
    args = ap.parse_args(argv)
    from slipstream.provenance import header, provenance  # noqa: E402

    print(header(provenance()), flush=True)
    if not torch.cuda.is_available():
        print("profile_forward_cuda: needs a GPU", file=sys.stderr)
        return 2
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

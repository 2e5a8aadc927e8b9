"""Where a decode step's GPU time goes: graph replay vs eager forward, kernels per step, top kernels.

    python tools/gpu/profile_forward_cuda.py [--model random-smollm2-135m] [--dtype bfloat16] [--batches 1 32 128 256]
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
(separate q/k/v and gate/up matmuls as well), `gemv` (the default with QKV, o_proj and down on cuBLAS or
the split-K GEMV, per shape and row count up to 8, whichever measured faster at start: the table is
printed), `before` (main before issue 42: the 8-launch layer with
the per-head attention kernel, attention_per_head_triton.py), so one run shows before and after.

`--launch both` (default) also times the eager forward with the thin launcher
(slipstream/models/kernels/triton_launch.py) right after Triton's own, on the same step: the
"eager thin ms" column; `--launch triton` leaves it out.

`--model` takes any spec, e.g. the random Llama-3.2 shapes (`random-llama-3.2-1b`, `random-llama-3.2-3b`,
weights drawn on the GPU); the output starts with a `# <model>` heading, so runs appended to one file make
one section per model. `--prefill 2048` adds a table per variant: one sequence's 2,048-token prompt chunk
(from position 0) as one step, its mixed-graph replay and eager forward timed with CUDA events, in
TFLOP/s (prefill_flops: the projections, the lm_head row sampled and causal attention) beside the GPU's
dense bf16 peak (tools/gpu/gpu_peaks.py). `--no-warmup` captures only the graphs measured (on first use),
not every bucket at start: what a large shape's call can afford.
"""
from __future__ import annotations

import argparse
import functools
import asyncio
import math
import sys

import numpy as np
import torch

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))))  # this checkout
_sys.path.insert(0, _os.path.dirname(_os.path.abspath(__file__)))

from gpu_peaks import dense_bf16_peak  # noqa: E402

from slipstream import Engine, EngineConfig  # noqa: E402
from slipstream.models.kernels import attention_triton  # noqa: E402
from slipstream.models.kernels import triton_launch  # noqa: E402
from slipstream.models.kernels.gemm_choice import event_ms  # noqa: E402
from slipstream.models.llama import forward_triton as llama_triton  # noqa: E402
from slipstream.runtime.batch import SeqWork, pack_step  # noqa: E402
from slipstream.runtime.graphs.static_step import fill_static  # noqa: E402


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
    # that, with cuBLAS or the split-K GEMV per projection shape up to 8 rows, measured at start (issue 50)
    "gemv": llama_triton.TritonOptions(small_gemm_max_rows=8),
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


def prefill_flops(config, tokens: int, sampled: int = 1) -> float:
    """FLOPs of one forward over a `tokens`-token chunk from position 0: 2 per multiply-add of every
    projection (q, k, v, o, gate, up, down) for every token, of the lm_head for the `sampled` rows, and
    of causal attention (query i reads i + 1 keys: QKᵀ and PV, 4·heads·head_dim per key); norms, rotary,
    SiLU and the embedding lookup are not counted."""
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size
    projections = 2 * per_layer * config.num_layers * tokens
    attention = 4 * q * (tokens * (tokens + 1) // 2) * config.num_layers
    return float(projections + attention + 2 * h * config.vocab_size * sampled)


def stage_prefill(runner, tokens: int):
    """Row 1 takes one `tokens`-token prompt chunk from position 0 (pages 1.. of the pool), staged in slot 0's
    arena for the eager forward and, where a token bucket holds it, for its mixed graph (captured here on
    first use): (eager StepTensors, (bucket, graph) or None)."""
    kv = runner.kv
    pages = -(-(tokens + 1) // kv.page_size)
    runner.rows.pages[1, :pages] = torch.arange(1, pages + 1, device=kv.k.device)
    ids = np.random.default_rng(0).integers(3, min(1000, runner.model.config.vocab_size), tokens).tolist()
    packed = pack_step(np.arange(1, 1), [SeqWork(row=1, tokens=ids, start_pos=0, sample=True)])
    arena = runner.slots[0].arena
    found = runner.mixed_graphs.lookup(0, packed.num_tokens) if runner.mixed_graphs is not None else None
    layout = arena.fill(packed)
    if found is not None:
        fill_static(arena, packed, found[0])
    arena.upload()
    return arena.tensors(layout), found


def profile_prefill(runner, config, tokens: int, args) -> None:
    """One sequence's `tokens`-token prompt chunk as one step: replay and eager forward, TFLOP/s."""
    tensors, found = stage_prefill(runner, tokens)
    with torch.cuda.stream(runner.device.compute.stream):
        eager_ms = event_ms(lambda: runner.forward.logits(tensors), args.repeats)
        graph_ms = event_ms(found[1].replay, args.repeats) if found is not None else float("nan")
    flops = prefill_flops(config, tokens)
    name = torch.cuda.get_device_name()
    peak = dense_bf16_peak(name)
    print(f"\nprefill: one {tokens}-token chunk (position 0) as one step, {flops / 1e12:.2f} TFLOP "
          f"(prefill_flops); peak: {name}'s dense bf16 tensor-core peak, "
          f"{'not in tools/gpu/gpu_peaks.py' if peak is None else f'{peak:.0f} TFLOP/s (tools/gpu/gpu_peaks.py)'}\n")
    print("| prefill tokens | path | device ms | TFLOP/s | % of dense bf16 peak |\n|---:|---|---:|---:|---:|")
    for path, ms in (("mixed-graph replay", graph_ms), ("eager forward", eager_ms)):
        rate = flops / (ms / 1e3) / 1e12
        share = "n/a" if peak is None or math.isnan(ms) else f"{100 * rate / peak:.1f}"
        print(f"| {tokens} | {path} | {ms:.3f} | {rate:.1f} | {share} |")


async def profile_variant(args) -> None:
    top = max(args.batches)
    prefill = max(args.prefill, default=0)
    cfg = EngineConfig(model=args.model, device="cuda", dtype=args.dtype, max_batch_size=top,
                       kv_cache_tokens=max(top * (args.context + 32), prefill + 64),
                       max_num_batched_tokens=max(512, top, prefill), warmup=args.warmup)
    async with Engine(cfg) as engine:
        runner = engine._parts.runner
        kv, compute = runner.kv, runner.device.compute.stream
        kv.k.normal_()
        kv.v.normal_()
        runner.rows.last_token.random_(3, 1000)
        pages = -(-(args.context + 1) // kv.page_size)
        print(f"{args.model} ({args.dtype}) on {torch.cuda.get_device_name()}, context {args.context}, "
              f"torch {torch.__version__}\n")
        chosen = getattr(runner.model, "small_gemms", None)
        if chosen:  # the `gemv` variant: what the measurement at start chose, per (rows, N, K)
            print("small GEMMs chosen at start (rows, N, K: kernel): " + "; ".join(
                f"{r}, {n}, {k}: {'cuBLAS' if c is None else f'GEMV {c.block_n} columns, split {c.split}'}"
                for (r, n, k), c in sorted(chosen.items())) + "\n")
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
            arena = runner.slots[0].arena
            layout = arena.fill(packed)
            arena.upload()
            tensors = arena.tensors(layout)

            def reset_positions() -> None:  # each forward advances them: hold every row at the context
                runner.rows.pos[1:n + 1] = args.context

            with torch.cuda.stream(compute):
                eager = lambda: reset_positions() or runner.forward.logits(tensors)  # noqa: E731
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
        for tokens in args.prefill:
            profile_prefill(runner, runner.model.config, tokens, args)
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
    ap.add_argument("--prefill", type=int, nargs="*", default=[], metavar="TOKENS",
                    help="also time a prompt chunk of TOKENS tokens as one step, in TFLOP/s (e.g. 2048)")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="capture every graph bucket at start (--no-warmup: only those measured, on first use)")
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.repeats < 1 or args.context < 1 or any(t < 1 for t in args.prefill):
        ap.error("need --batches >= 1, --repeats >= 1, --context >= 1 and --prefill tokens >= 1")
    from slipstream.provenance import header, provenance  # noqa: E402

    print(header(provenance()), flush=True)
    print(f"\n# {args.model}\n", flush=True)
    if not torch.cuda.is_available():
        print("profile_forward_cuda: needs a GPU", file=sys.stderr)
        return 2
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

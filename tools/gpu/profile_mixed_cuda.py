"""Host launch cost of a mixed (prefill + decode) step: eager forward vs mixed-graph replay.

    python tools/gpu/profile_mixed_cuda.py [--model random-smollm2-135m] [--dtype bfloat16] [--tokens 128 512 2048]
                                       [--decode 16] [--chunk 256] [--context 128] [--repeats 30]

Builds an Engine on the GPU (mixed graphs on, captured lazily for the token buckets asked for) and,
for each T, builds one step: --decode decoding rows at --context tokens, then prompt chunks of at
most --chunk tokens (fresh sequences, each sampled) filling the step to T tokens. Per repeat it
times, on the host (perf_counter): the runner's whole `launch_forward` (staging, upload, row-table
writes, then the eager forward or the graph replay: what the tick pays), and the bare eager
forward's and replay's launches; on the device (CUDA events) the bare forward and replay. Every forward advances the decode rows' positions, so they are reset
(outside the host timing) before each. Prints median / mean / p90 per column. Needs a GPU: without
one it exits with code 2 after parsing its arguments.

--launch picks how the eager forward launches its Triton kernels: `triton` (Triton's own launcher),
`thin` (slipstream/models/kernels/triton_launch.py) or `both` (default: both eager columns in one
table, interleaved per repeat, with the thin launcher's hit/miss/fallback counts).
"""
from __future__ import annotations

import argparse
import asyncio
import os as _os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))))  # this checkout

from slipstream import Engine, EngineConfig  # noqa: E402
from slipstream.runtime.batch import SeqWork, pack_step  # noqa: E402
from slipstream.runtime.graphs.static_step import fill_static  # noqa: E402
from slipstream.models.kernels import triton_jit, triton_launch  # noqa: E402


def stats(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(round(0.9 * (len(xs) - 1))))]
    return f"{statistics.median(xs):.1f} / {statistics.mean(xs):.1f} / {p90:.1f}"


def thin_counts() -> str:
    """Thin launches that hit, missed (went through Triton once) and fell back to Triton, per kernel."""
    return "; ".join(f"{fn.__name__}: {k.hits} hits, {k.misses} misses, {k.fallbacks} fallbacks"
                     for fn, k in triton_jit._THIN.items())


def mixed_step(tokens: int, decode: int, chunk: int, rng: np.random.Generator):
    """Rows 1..decode decode; rows after them take prompt chunks up to `tokens` tokens in all."""
    chunks, row, left = [], decode + 1, tokens - decode
    while left > 0:
        n = min(chunk, left)
        chunks.append(SeqWork(row=row, tokens=rng.integers(3, 1000, n).tolist(), start_pos=0, sample=True))
        row, left = row + 1, left - n
    return pack_step(np.arange(1, decode + 1), chunks), row - 1


def timed(fn, host: list[float], device: list[float], before=None) -> None:
    """Run `fn` on the current stream: host µs around the call, device ms between events around it."""
    if before is not None:
        before()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host.append((time.perf_counter() - t0) * 1e6)
    end.record()
    end.synchronize()
    device.append(start.elapsed_time(end))


async def main_async(args) -> None:
    top = max(args.tokens)
    rows_needed = args.decode + sum(-(-(t - args.decode) // args.chunk) for t in [top])
    per_row_pages = -(-(max(args.context, args.chunk) + 2) // 16)
    cfg = EngineConfig(model=args.model, device="cuda", dtype=args.dtype, max_batch_size=max(rows_needed, 1),
                       max_num_batched_tokens=top, kv_cache_tokens=(rows_needed + 1) * per_row_pages * 16,
                       page_size=16, warmup=False)
    rng = np.random.default_rng(0)
    async with Engine(cfg) as engine:
        runner = engine._parts.runner
        kv, compute = runner.kv, runner.device.compute.stream
        kv.k.normal_()
        kv.v.normal_()
        runner.rows.last_token.random_(3, 1000)
        rows = torch.arange(1, rows_needed + 1, device=kv.k.device)
        runner.rows.pages[1:rows_needed + 1, :per_row_pages] = (
            1 + per_row_pages * (rows[:, None] - 1) + torch.arange(per_row_pages, device=rows.device)[None, :])
        print(f"{args.model} ({args.dtype}) on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
              f"{args.decode} decode rows at context {args.context}, chunks of <= {args.chunk} tokens; "
              f"{args.repeats} repeats after {args.warmup} warm-up runs\n")
        eagers = {"triton": [("eager", False)], "thin": [("thin", True)],
                  "both": [("eager", False), ("thin", True)]}[args.launch]
        names = [n for n, _ in eagers]
        label = {"eager": "eager", "thin": "eager thin"}
        cols = ([f"launch_forward host µs, {label[n]}" for n in names] + ["launch_forward host µs, graph"]
                + [f"forward launch host µs, {label[n]}" for n in names] + ["replay launch host µs"]
                + [f"forward device ms, {label[n]}" for n in names] + ["replay device ms"])
        print("| T | real tokens | seqs | " + " | ".join(cols) + " |")
        print("|---:|---:|---:|" + "---:|" * len(cols))
        arena = runner.slots[0].arena
        step_id = 0
        for t in args.tokens:
            packed, _ = mixed_step(t, args.decode, args.chunk, rng)
            found = runner.mixed_graphs.lookup(0, packed.num_tokens)
            if found is None:
                print(f"| {t} | {packed.num_tokens} | {packed.num_seqs} | above the largest token bucket "
                      + "| " * (len(cols) - 1) + "|")
                continue
            bucket, graph = found
            graphs = runner.mixed_graphs

            def reset() -> None:  # every forward advances the decode rows: hold them at the context
                runner.rows.pos[1:args.decode + 1] = args.context

            def whole_launch(use_graph: bool, out: list[float], thin: bool = False) -> None:
                """What the engine's tick pays: staging, upload, row-table writes, forward or replay."""
                nonlocal step_id
                step_id += 1
                triton_launch.set_enabled(thin)
                runner.mixed_graphs = graphs if use_graph else None
                with torch.cuda.stream(compute):
                    reset()
                t0 = time.perf_counter()
                launched = runner.launch_forward(step_id, packed)
                out.append((time.perf_counter() - t0) * 1e6)
                runner.device.compute.record().synchronize()
                launched.slot.release()
                runner.mixed_graphs = graphs

            lay = arena.fill(packed)
            fill_static(arena, packed, bucket)
            arena.upload()
            eager_tensors = arena.tensors(lay)
            whole = {n: [] for n in names + ["graph"]}
            host = {n: [] for n in names + ["graph"]}
            device = {n: [] for n in names + ["graph"]}
            for i in range(args.warmup + args.repeats):
                keep = i >= args.warmup
                for name, thin in eagers:
                    whole_launch(False, whole[name] if keep else [], thin)
                whole_launch(True, whole["graph"] if keep else [])
                arena.fill(packed)  # launch_forward rewrote the same step: stage it again for the bare forwards
                fill_static(arena, packed, bucket)
                arena.upload()
                with torch.cuda.stream(compute):
                    for name, thin in eagers + [("graph", False)]:
                        triton_launch.set_enabled(thin)
                        fn = graph.replay if name == "graph" else (lambda: runner.forward.logits(eager_tensors))
                        h, d = (host[name], device[name]) if keep else ([], [])
                        timed(fn, h, d, before=reset)
                triton_launch.set_enabled(False)
            order = names + ["graph"]
            print(f"| {t} | {packed.num_tokens} | {packed.num_seqs} | "
                  + " | ".join([stats(whole[n]) for n in order] + [stats(host[n]) for n in order]
                               + [stats(device[n]) for n in order]) + " |", flush=True)
        print("\nmedian / mean / p90 of each column; host µs: perf_counter around the call; device ms: CUDA "
              "events around the forward alone")
        if "thin" in names:
            print(f"thin launcher (triton_launch.py), all kernels: {thin_counts()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random-smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048], help="step sizes T (token buckets)")
    ap.add_argument("--decode", type=int, default=16, help="decoding rows in each step")
    ap.add_argument("--chunk", type=int, default=256, help="largest prompt chunk")
    ap.add_argument("--context", type=int, default=128, help="context of the decoding rows")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--launch", choices=("triton", "thin", "both"), default="both",
                    help="how the eager forward launches its Triton kernels")
    args = ap.parse_args(argv)
    if min(args.tokens) <= args.decode or args.decode < 0 or args.chunk < 1 or args.repeats < 1:
        ap.error("need --tokens > --decode >= 0, --chunk >= 1, --repeats >= 1")
    from slipstream.provenance import header, provenance

    print(header(provenance()), flush=True)
    if not torch.cuda.is_available():
        print("profile_mixed_cuda: needs a GPU (none found)", file=sys.stderr)
        return 2
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

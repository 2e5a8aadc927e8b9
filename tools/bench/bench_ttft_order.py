"""Why depth 2's time to first token was above depth 1's, measured without a GPU.

    python tools/bench/bench_ttft_order.py                 # concurrency 1 8 32 128, 3 repeats
    python tools/bench/bench_ttft_order.py --prefill-launch-ms 0 # launches that cost nothing (graphs)

The suspected mechanism (issue 15): at depth 2 the loop launches step t+1 before it commits step
t. On CUDA an eager prefill/mixed launch costs the host 22–27 ms (H100, docs/results/h100-2026-11-22),
so a request whose first token was sampled in step t sees it only after that launch: a TTFT
penalty depth 1 does not pay (it commits t, then launches t+1).

This tool runs the real engine (API, planner, loop, runner, output stage) with bench_host's
NullModel on the CPU device and two emulated costs taken from that H100 table:
  * device time per forward: `--forward-ms` + `--forward-us-per-token` × tokens, slept on the
    device's compute thread (the loop runs meanwhile, as beside a GPU);
  * host time of launching a step that carries prompt chunks: `--prefill-launch-ms`, spent busy
    on the loop thread (Python launching eager kernels holds the loop); decode steps launch at the
    real (graph-like) cost.
Three orders: depth 1; depth 2 launching before committing (the order before the fix, restored by
making `runner.is_done` always False); depth 2 committing first when the oldest step's tokens are
already on the host (EngineLoop.tick). TTFT is measured at the client: submission to the first
streamed token; all requests arrive at once. (The loop's other TTFT fix, yielding once per tick so
a host-bound loop cannot starve the output stage, is in all three: its effect needs a device that
is ahead of the host without the GIL, which this CPU emulation is not; the test
tests/test_pipeline_invariants.py::test_a_host_bound_loop_still_lets_streams_and_the_output_stage_run
shows it with a device that completes at once.)
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's slipstream
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_host, beside it

from bench_host import NullModel, null_model  # noqa: E402

ORDERS = ("depth 1", "depth 2, launch first", "depth 2, commit first when done")


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


async def run_order(order: str, concurrency: int, args) -> list[float]:
    from slipstream.api.engine import Engine
    from slipstream.params import EngineConfig, SamplingParams

    depth = 1 if order == "depth 1" else 2
    top = max(args.concurrency)
    config = EngineConfig(model="tiny-random", device="cpu", pipeline_depth=depth, max_batch_size=top,
                          max_num_batched_tokens=args.step_tokens,
                          kv_cache_tokens=2 * top * (args.prompt_len + args.output_len + 16))
    real_forward = NullModel.forward

    def timed_forward(self, batch, kv):
        time.sleep((args.forward_ms + args.forward_us_per_token * batch.input_ids.shape[0] / 1e3) / 1e3)
        return real_forward(self, batch, kv)

    NullModel.forward = timed_forward
    try:
        with null_model(max_rows=max(top, args.step_tokens) + 1):
            engine = await Engine(config).start()
        runner = engine._parts.runner
        real_launch = runner.launch_forward

        def launch_forward(step_id, packed, **kw):
            if len(packed.chunk_rows):
                _busy(args.prefill_launch_ms)
            return real_launch(step_id, packed, **kw)

        runner.launch_forward = launch_forward
        if order == "depth 2, launch first":
            runner.is_done = lambda step: False
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        ttfts: list[float] = []
        commit_ttft: list[float] = []

        async def client(i: int) -> None:
            prompt = [100 + (7 * i + j) % 150 for j in range(args.prompt_len)]
            t0 = time.perf_counter()
            first = None
            stream = engine.stream(prompt, params)
            async for delta in stream:
                if first is None and delta.token_ids:
                    first = time.perf_counter() - t0
            ttfts.append(first * 1e3)
            if args.debug:
                m = stream._seq.user.metrics  # (private: a debugging aid)
                commit_ttft.append((m.first_token - m.arrival) * 1e3)

        try:
            await asyncio.gather(*(client(i) for i in range(concurrency)))  # warm-up
            ttfts.clear()
            for _ in range(args.repeats):
                await asyncio.gather(*(client(i) for i in range(concurrency)))
        finally:
            await engine.close()
        if args.debug and commit_ttft:
            print(f"  {order}, {concurrency}: TTFT at the commit, mean {statistics.fmean(commit_ttft):.1f} ms", flush=True)
        return ttfts
    finally:
        NullModel.forward = real_forward


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[8] if len(xs) > 1 else xs[0]


async def main_async(args) -> None:
    print(f"emulated: forward {args.forward_ms} ms + {args.forward_us_per_token} µs/token on the device thread; "
          f"launch of a step with prompt chunks {args.prefill_launch_ms} ms busy on the loop; prompts "
          f"{args.prompt_len} tokens, {args.output_len} out, {args.step_tokens} tokens per step, "
          f"{args.repeats} repeats after a warm-up\n")
    print("| concurrency | order | TTFT median ms | mean | p90 | vs depth 1 (mean) |")
    print("|---:|---|---:|---:|---:|---:|")
    for c in args.concurrency:
        base = None
        for order in ORDERS:
            xs = await run_order(order, c, args)
            mean = statistics.fmean(xs)
            base = mean if base is None else base
            print(f"| {c} | {order} | {statistics.median(xs):.1f} | {mean:.1f} | {_p90(xs):.1f} | "
                  f"{mean / base:.2f}× |", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--step-tokens", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--forward-ms", type=float, default=1.6, help="device time of a step, fixed part")
    ap.add_argument("--forward-us-per-token", type=float, default=4.0, help="device time per input token")
    ap.add_argument("--prefill-launch-ms", type=float, default=25.0, help="host time to launch a prefill/mixed step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--debug", action="store_true")
    args = ap.parse_args(argv)
    for name in ("forward_ms", "forward_us_per_token", "prefill_launch_ms"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be >= 0")
    from slipstream.provenance import header, provenance

    print(header(provenance()), flush=True)
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())

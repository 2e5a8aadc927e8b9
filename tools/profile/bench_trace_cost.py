"""What always-on tracing costs per decode step: the same workload with EngineConfig(trace=False/True).

    python tools/profile/bench_trace_cost.py               # tiny-random, 8 streams x 64 tokens, depth 2
    python tools/profile/bench_trace_cost.py --model smollm2-135m --streams 4 --len 32

The worker traces by default (`slipstream worker --no-trace` turns it off) so that the bubble
series of /metrics (slipstream_device_idle_seconds, slipstream_forward_seconds) are filled. One
process, one engine per setting, runs alternating off/on after a warm-up; the figure is wall time
per committed step. tiny-random has the shortest steps, so it shows the largest relative cost.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from provenance import header  # noqa: E402

from slipstream import Engine, EngineConfig, SamplingParams  # noqa: E402


async def _per_step(engine: Engine, streams: int, length: int) -> float:
    params = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
    steps0 = engine.loop.num_steps
    t0 = time.perf_counter()
    await asyncio.gather(*(engine.complete([100 + i, 5, 6], params) for i in range(streams)))
    return (time.perf_counter() - t0) / (engine.loop.num_steps - steps0)


def _row(name: str, xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"| {name} | {statistics.median(xs) * 1e3:.3f} | {statistics.mean(xs) * 1e3:.3f} | {p90 * 1e3:.3f} |"


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--len", type=int, default=64, dest="length")
    ap.add_argument("--depth", type=int, default=2, choices=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    engines = {}
    for trace in (False, True):
        engines[trace] = await Engine(EngineConfig(model=args.model, pipeline_depth=args.depth, trace=trace,
                                                   max_batch_size=max(args.streams, 8))).start()
    got: dict[bool, list[float]] = {False: [], True: []}
    try:
        for trace in (False, True):  # warm-up
            await _per_step(engines[trace], args.streams, args.length)
        for _ in range(args.repeats):
            for trace in (False, True):
                got[trace].append(await _per_step(engines[trace], args.streams, args.length))
    finally:
        for e in engines.values():
            await e.close()
    print(header())
    print(f"\n{args.model}, depth {args.depth}, {args.streams} streams x {args.length} tokens, "
          f"{args.repeats} alternating repeats; wall time per committed step\n")
    print("| trace | median ms/step | mean | p90 |\n|---|---|---|---|")
    print(_row("off", got[False]))
    print(_row("on", got[True]))
    ratios = [on / off for off, on in zip(got[False], got[True])]
    print(f"\non/off per repeat pair: median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    asyncio.run(main())

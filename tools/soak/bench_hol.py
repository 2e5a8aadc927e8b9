"""Head-of-line blocking: how long a short request takes while a long prompt is being prefilled.

    python tools/soak/bench_hol.py                 # tiny-random, 64-token step budget, 2,048-token prompt

Both figures come from one run, one engine, alternating: the short request alone, then the same
short request submitted right after a long prompt has started prefilling in chunks. Before the
planner shared the step budget among prompts, the short one waited for the whole long prefill.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
import time

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout, not an installed one

from slipstream import Engine, EngineConfig, SamplingParams


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def main(args) -> None:
    config = EngineConfig(model=args.model, pipeline_depth=args.depth, max_batch_size=16,
                          max_num_batched_tokens=args.budget, kv_cache_tokens=2 * args.long + 1024, page_size=16)
    short = SamplingParams(max_tokens=args.short_tokens, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    long_prompt = [3 + (i * 7) % 250 for i in range(args.long)]
    alone, behind, long_s = [], [], []
    async with Engine(config) as engine:
        await engine.complete([5, 6, 7, 8], short)  # warm up
        for r in range(args.repeats + 1):
            t0 = time.perf_counter()
            await engine.complete([5, 6, 7, 8 + r], short)
            t_alone = time.perf_counter() - t0
            steps = (await engine.stats())["steps"]
            t_long = time.perf_counter()
            long_task = asyncio.create_task(engine.complete(long_prompt, long_params))
            while (await engine.stats())["steps"] < steps + 2:  # the long prompt is prefilling now
                await asyncio.sleep(0.0005)
            t0 = time.perf_counter()
            await engine.complete([5, 6, 7, 8 + r], short)
            t_behind = time.perf_counter() - t0
            await long_task
            if r:  # the first pair is a warm-up
                alone.append(t_alone)
                behind.append(t_behind)
                long_s.append(time.perf_counter() - t_long)
    print(f"# model {args.model}, step budget {args.budget} tokens, long prompt {args.long} tokens, "
          f"short request 4 + {args.short_tokens} tokens, depth {args.depth}, {args.repeats} repeats")
    print("| short request | median ms | mean ms | p90 ms |")
    print("|---|---:|---:|---:|")
    for name, xs in (("alone", alone), ("while the long prompt prefills", behind), ("(the long prompt itself)", long_s)):
        print(f"| {name} | {1e3 * statistics.median(xs):.1f} | {1e3 * statistics.mean(xs):.1f} | {1e3 * pct(xs, 0.9):.1f} |")
    ratio = statistics.median(behind) / statistics.median(alone)
    print(f"ratio (medians): {ratio:.2f}x  (goal: <= 3x); mean ratio {statistics.mean(behind) / statistics.mean(alone):.2f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--long", type=int, default=2048)
    ap.add_argument("--short-tokens", type=int, default=8)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    from slipstream.logging_setup import configure_logging

    configure_logging("warning")
    print(f"# command: {' '.join(sys.argv)}")
    asyncio.run(main(args))

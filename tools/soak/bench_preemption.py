"""Preemptions at depth 1 vs depth 2 under a KV pool too small for the load (one run, one process).

    python tools/soak/bench_preemption.py     # 16 streams, 24 pages of 16 tokens, tiny-random

At depth 2 a victim with a step in flight frees nothing until that step commits. The planner
counts those pages as coming back and skips a row for a step instead of preempting more; before,
it went on preempting every later running sequence (17 preemptions at depth 1, 51 at depth 2).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout, not an installed one

from slipstream import Engine, EngineConfig, SamplingParams


def args_prompt(i):
    return 4 + (i * 7) % 29


async def run(depth: int, streams: int, pages: int, tokens: int) -> tuple[int, list]:
    config = EngineConfig(model="tiny-random", pipeline_depth=depth, max_batch_size=streams,
                          max_num_batched_tokens=max(64, streams), kv_cache_tokens=pages * 16, page_size=16)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    async with Engine(config) as engine:
        outs = await asyncio.gather(*(engine.complete([3 + (i * 5 + j) % 250 for j in range(args_prompt(i))], params) for i in range(streams)))
        return (await engine.stats())["preemptions"], [o.token_ids for o in outs]


async def main(args) -> None:
    print("| depth | preemptions | outputs equal depth 1 |")
    print("|---:|---:|---|")
    base = None
    for depth in (1, 2):
        n, outs = await run(depth, args.streams, args.pages, args.tokens)
        base = base or outs
        print(f"| {depth} | {n} | {outs == base} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=120)
    args = ap.parse_args()
    from slipstream.logging_setup import configure_logging

    configure_logging("warning")
    print(f"# command: {' '.join(sys.argv)}")
    asyncio.run(main(args))

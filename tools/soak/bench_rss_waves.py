"""RSS per wave of abandoned streams (issue 37, item 6): does the engine give memory back?

    python tools/soak/bench_rss_waves.py --waves 90                  # the default (fast) CPU path
    python tools/soak/bench_rss_waves.py --waves 90 --batch-invariant     # torch's dense kernels
    python tools/soak/bench_rss_waves.py --waves 40 --out docs/results/inputs-2026-11-27/rss_waves.txt

Each wave opens `--streams` streams with prompts of random lengths (so steps see many token
counts), reads `--deltas` deltas from each and drops it (the close aborts the request), then waits
for the engine to settle and records the process's RSS. A steady engine keeps RSS flat after the
first waves; growth per wave past `--skip` waves is printed (slope of a least-squares line, MB per
wave) beside first / last / max.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from bench_lines import emit, report_async, rss_mb  # noqa: E402

from slipstream import Engine, EngineConfig, SamplingParams  # noqa: E402


def slope(ys: list[float]) -> float:
    """Least-squares MB per wave."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


async def one_stream(engine: Engine, prompt: list[int], deltas: int) -> None:
    stream = engine.stream(prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    seen = 0
    async for _ in stream:
        seen += 1
        if seen >= deltas:
            break
    await stream.aclose()


async def settle(engine: Engine) -> None:
    while True:
        s = await engine.stats()
        if s["running"] == 0 and s["waiting"] == 0 and s["inflight_steps"] == 0:
            return
        await asyncio.sleep(0.01)


async def run(args, lines: list[str]) -> None:
    rng = random.Random(args.seed)
    config = EngineConfig(model=args.model, batch_invariant=args.batch_invariant, seed=1)
    async with Engine(config) as engine:
        vocab = engine.tokenizer.vocab_size if hasattr(engine.tokenizer, "vocab_size") else 256
        rss: list[float] = []
        emit(lines, f"model {args.model}  batch_invariant {args.batch_invariant}  streams {args.streams}/wave  "
                    f"deltas {args.deltas}  waves {args.waves}")
        emit(lines, "wave  rss_mb")
        for w in range(args.waves):
            prompts = [[rng.randrange(3, min(vocab, 259)) for _ in range(rng.randint(1, args.max_prompt))]
                       for _ in range(args.streams)]
            await asyncio.gather(*(one_stream(engine, p, args.deltas) for p in prompts))
            await settle(engine)
            rss.append(rss_mb())
            emit(lines, f"{w + 1:4d}  {rss[-1]:.1f}")
        tail = rss[args.skip:]
        emit(lines, "")
        emit(lines, f"rss first {rss[0]:.1f} MB  after wave {args.skip} {rss[min(args.skip, len(rss) - 1)]:.1f}  "
                    f"last {rss[-1]:.1f}  max {max(rss):.1f}  "
                    f"slope after wave {args.skip}: {slope(tail):+.2f} MB/wave")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--waves", type=int, default=40)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--deltas", type=int, default=2)
    ap.add_argument("--max-prompt", type=int, default=300, help="prompt lengths drawn from 1..this")
    ap.add_argument("--skip", type=int, default=10, help="waves left out of the slope (warm-up)")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    report_async(run, args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

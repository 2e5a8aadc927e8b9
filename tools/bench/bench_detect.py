"""detect requests per second at 1, 8 and 32 concurrent requests, depth 2 vs depth 1, in one run
(issue 31, must-show 4).

    python tools/bench/bench_detect.py                            # the tiny random Moondream folder, CPU
    python tools/bench/bench_detect.py --skills-model idefics3    # the tiny Idefics3: grammar-constrained text
    python tools/bench/bench_detect.py --model ~/models/moondream2 --device cuda --step-tokens 1024
    python tools/bench/bench_detect.py --out docs/results/skills-2026-11-25/bench_detect.txt

Without --model a tiny random-weight folder is built into a temporary directory: Moondream
(tests/moondream_fixture.py: `Engine.detect` decodes the boxes with the region heads, the values
carried on the device) or Idefics3 (tests/idefics3_fixture.py: the boxes are grammar-constrained
text, slipstream/api/skills.py). Random weights: the boxes mean nothing, and how many objects a
request finds (1 to --max-objects) is whatever the weights say; the table gives the mean.

For each pipeline depth (`--depths`, 2 then 1) a fresh engine: a warm-up at the highest concurrency, then for
each concurrency c, `--repeats` rounds of a closed loop: c callers, each calling `Engine.detect` on
a picture of a pool of 8 (all encoded during the warm-up: encoder-cache hits, so the figure is the
decode of the boxes, not the vision tower) until the round has `--requests-per-round` answers.
req/s = answers of a round / its wall time (mean over rounds; min-max beside it); latency = call to
answer of every request, mean / median / p90 over all rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools" / "common")]  # the slipstream of this checkout, the shared helpers

from slipstream import Engine, EngineConfig  # noqa: E402
from bench_lines import emit, pct, picture, report  # noqa: E402

OBJECTS = ["cat", "dog", "box", "tree"]


def pictures(n: int, width: int, height: int) -> list[Image.Image]:
    return [picture(seed, width, height) for seed in range(n)]


async def round_(engine: Engine, concurrency: int, total: int, pics: list, max_objects: int):
    """A closed loop of `concurrency` callers until `total` answers: (latencies, objects found, wall s)."""
    latencies: list[float] = []
    found: list[int] = []
    next_i = 0

    async def caller():
        nonlocal next_i
        while next_i < total:
            i = next_i
            next_i += 1
            t = time.perf_counter()
            out = await engine.detect("", OBJECTS[i % len(OBJECTS)], max_objects, images=[pics[i % len(pics)]])
            latencies.append(time.perf_counter() - t)
            found.append(len(out["objects"]))

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    return latencies, found, time.perf_counter() - t0


async def bench_depth(args, model: str, depth: int, pics: list, lines: list[str]) -> None:
    top = max(args.concurrency)
    config = EngineConfig(model=model, device=args.device, dtype=args.dtype, pipeline_depth=depth,
                          max_batch_size=top, max_num_batched_tokens=args.step_tokens,
                          kv_cache_tokens=args.kv_cache_tokens, prefix_caching=args.prefix_caching)
    async with Engine(config) as engine:
        await round_(engine, top, max(top, 2 * len(pics)), pics, args.max_objects)  # warm-up: every picture encoded
        for c in args.concurrency:
            total = max(args.requests_per_round, c)
            lat, found, rates = [], [], []
            for _ in range(args.repeats):
                before = await engine.stats()
                lt, fd, wall = await round_(engine, c, total, pics, args.max_objects)
                lat += lt
                found += fd
                rates.append(len(lt) / wall)
            runs = (await engine.stats())["encoder_cache_misses"] - before["encoder_cache_misses"]
            emit(lines, f"| {depth} | {c} | {total} x {args.repeats} | {statistics.mean(rates):.2f} "
                        f"({min(rates):.2f}-{max(rates):.2f}) | {statistics.mean(lat) * 1e3:.0f} | "
                        f"{statistics.median(lat) * 1e3:.0f} | {pct(lat, 0.9) * 1e3:.0f} | "
                        f"{statistics.mean(found):.2f} | {runs} |")


async def main(args, model: str, what: str) -> list[str]:
    lines: list[str] = []
    pics = pictures(8, args.width, args.height)
    emit(lines, f"model: {model} ({what}); device {args.device}, {args.dtype}; Engine.detect, max_objects "
                f"{args.max_objects}, greedy; pictures {args.width}x{args.height} (a pool of 8, encoded in the "
                f"warm-up); prefix caching {'on' if args.prefix_caching else 'off'}; max_num_batched_tokens "
                f"{args.step_tokens}; a fresh engine per depth; load average at the start "
                f"{'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    emit(lines)
    emit(lines, "| depth | concurrent | requests x rounds | req/s mean (min-max) | latency mean (ms) "
                "| median (ms) | p90 (ms) | objects / answer | encoder runs (last round) |")
    emit(lines, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for depth in args.depths:
        await bench_depth(args, model, depth, pics, lines)
    emit(lines)
    emit(lines, f"load average at the end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    return lines


def tiny_folder(kind: str) -> tuple[str, str]:
    sys.path.insert(0, str(ROOT / "tests"))
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-detect-{kind}-"))
    if kind == "moondream":
        from moondream_fixture import tiny_moondream_folder

        return (str(tiny_moondream_folder(tmp / "moondream-tiny")),
                "random weights: the tiny Moondream of tests/moondream_fixture.py; boxes from the region heads")
    from idefics3_fixture import tiny_idefics3_folder

    return (str(tiny_idefics3_folder(tmp)),
            "random weights: the tiny Idefics3 of tests/idefics3_fixture.py; boxes as grammar-constrained text")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a moondream2 or Idefics3 folder; default: a tiny random one")
    ap.add_argument("--skills-model", default="moondream", choices=["moondream", "idefics3"],
                    help="which tiny random folder to build without --model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--depths", type=int, nargs="+", default=[2, 1],
                    help="pipeline depths, in this order (a fresh engine each; swap them to see an order effect)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests-per-round", type=int, default=32)
    ap.add_argument("--max-objects", type=int, default=4)
    ap.add_argument("--width", type=int, default=60)
    ap.add_argument("--height", type=int, default=40)
    ap.add_argument("--step-tokens", type=int, default=1024, help="max_num_batched_tokens (moondream2: >= 730)")
    ap.add_argument("--kv-cache-tokens", type=int, default=65536)
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                    help="off by default: every request computes its image prefix, as distinct pictures would")
    ap.add_argument("--out", type=Path, default=None, help="also write the table, with provenance, here")
    args = ap.parse_args()
    from slipstream.logging_setup import configure_logging

    configure_logging("warning")
    if args.model is None:
        model, what = tiny_folder(args.skills_model)
    else:
        model, what = args.model, "weights from the folder"
    report(lambda: asyncio.run(main(args, model, what)), args.out)

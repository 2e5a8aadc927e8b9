"""Images in the pipeline, one run (issue 30, must-show 4): TTFT and tokens/s with 0, 1 and 4 images
per request at 8 concurrent requests, and the encoder cache's effect on a repeated image.

    python tools/bench/bench_images.py                 # the tiny random-weight Idefics3, CPU
    python tools/bench/bench_images.py --model ~/models/SmolVLM-256M-Instruct --device cuda --dtype bfloat16
    python tools/bench/bench_images.py --out docs/results/images-2026-11-25/bench_images.txt

Without --model the tiny Idefics3 of tests/idefics3_fixture.py is built into a temporary folder
(random weights: the answers mean nothing, the costs are those of its small sizes). Every request is
a chat turn (`Engine.chat`, image parts first, then the text), greedy, `max_tokens` output tokens
with ignore_eos. Prefix caching is off, so a repeated image saves only what the encoder cache saves.

(a) For k in 0, 1, 4 images per request: a warm-up round, then `--repeats` rounds of `--concurrency`
    requests submitted at once, every picture new (each request's images are encoded: no cache hit).
    TTFT (arrival to the first token's commit) mean / median / p90 over all measured requests;
    tokens/s = output tokens of a round / the round's wall time, mean over the rounds.
(b) The encoder cache: `--concurrency` one-image requests at once, with (i) 8 distinct new pictures,
    (ii) one new picture for all, (iii) a picture already in the cache for all. Encoder runs
    (the cache's misses during the round) and TTFT, over `--repeats` rounds each.
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

from slipstream import Engine, EngineConfig, SamplingParams  # noqa: E402
from bench_lines import emit, pct, picture, report  # noqa: E402

TEXT = "Describe the picture in detail."


class Pictures:
    """Distinct random RGB pictures (a fresh seed each time: never seen by the encoder cache)."""

    def __init__(self, width: int, height: int):
        self.size, self.seed = (width, height), 0

    def new(self) -> Image.Image:
        self.seed += 1
        return picture(self.seed, *self.size)


def messages(images: list[Image.Image], i: int) -> list[dict]:
    text = f"{TEXT} (request {i})"
    if not images:
        return [{"role": "user", "content": text}]
    return [{"role": "user", "content": [{"type": "image", "image": im} for im in images]
             + [{"type": "text", "text": text}]}]


async def round_(engine: Engine, params: SamplingParams, images_per_request: list[list[Image.Image]]):
    """Submit every request at once; (ttfts, output tokens, wall seconds, encoder runs)."""
    before = (await engine.stats())["encoder_cache_misses"]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.chat(messages(ims, i), params) for i, ims in enumerate(images_per_request)))
    wall = time.perf_counter() - t0
    runs = (await engine.stats())["encoder_cache_misses"] - before
    return [o.metrics.ttft for o in outs], sum(len(o.token_ids) for o in outs), wall, runs


async def main(args, model: str, weights: str) -> list[str]:
    lines: list[str] = []
    n, pics = args.concurrency, Pictures(args.width, args.height)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    config = EngineConfig(model=model, device=args.device, dtype=args.dtype, max_batch_size=n,
                          max_num_batched_tokens=args.step_tokens, kv_cache_tokens=args.kv_cache_tokens,
                          prefix_caching=False, encoder_cache_tokens=args.encoder_cache_tokens)
    async with Engine(config) as engine:
        probe = await engine.chat(messages([pics.new()], 0), SamplingParams(max_tokens=1, temperature=0.0))
        rows = probe.usage.prompt_tokens - (await engine.chat(messages([], 0), SamplingParams(
            max_tokens=1, temperature=0.0))).usage.prompt_tokens  # (with the tile markers around them)
        emit(lines, f"model: {model} ({weights}); device {args.device}, {args.dtype}; {n} concurrent requests, "
                    f"{args.max_tokens} output tokens each (greedy, ignore_eos), {args.repeats} measured rounds "
                    f"after 1 warm-up; pictures {args.width}x{args.height} = {rows} prompt tokens each; "
                    f"prefix caching off; max_num_batched_tokens {args.step_tokens}")
        emit(lines)
        emit(lines, "## (a) 0, 1 and 4 images per request, every picture new")
        emit(lines)
        emit(lines, "| images / request | prompt tokens | TTFT mean (s) | TTFT median (s) | TTFT p90 (s) "
                    "| tokens/s | encoder runs / round |")
        emit(lines, "|---:|---:|---:|---:|---:|---:|---:|")
        for k in (0, 1, 4):
            await round_(engine, params, [[pics.new() for _ in range(k)] for _ in range(n)])  # warm-up
            ttfts, rates, runs = [], [], []
            for _ in range(args.repeats):
                t, toks, wall, r = await round_(engine, params, [[pics.new() for _ in range(k)] for _ in range(n)])
                ttfts += t
                rates.append(toks / wall)
                runs.append(r)
            prompt = await engine.chat(messages([pics.new() for _ in range(k)], 0),
                                       SamplingParams(max_tokens=1, temperature=0.0))
            emit(lines, f"| {k} | {prompt.usage.prompt_tokens} | {statistics.mean(ttfts):.3f} | "
                        f"{statistics.median(ttfts):.3f} | {pct(ttfts, 0.9):.3f} | {statistics.mean(rates):.1f} | "
                        f"{statistics.mean(runs):g} |")
        emit(lines)
        emit(lines, f"## (b) the encoder cache: {n} one-image requests at once")
        emit(lines)
        emit(lines, "| pictures | encoder runs / round | TTFT mean (s) | TTFT median (s) | TTFT p90 (s) | tokens/s |")
        emit(lines, "|---|---:|---:|---:|---:|---:|")
        cached = pics.new()
        await round_(engine, params, [[cached]])  # now in the cache
        cases = {"distinct (a new one each)": lambda: [[pics.new()] for _ in range(n)],
                 "the same new one for all": lambda: [[im] for im in [pics.new()] * n],
                 "the same one, already cached": lambda: [[cached] for _ in range(n)]}
        for name, make in cases.items():
            await round_(engine, params, make())  # warm-up
            ttfts, rates, runs = [], [], []
            for _ in range(args.repeats):
                t, toks, wall, r = await round_(engine, params, make())
                ttfts += t
                rates.append(toks / wall)
                runs.append(r)
            emit(lines, f"| {name} | {statistics.mean(runs):g} | {statistics.mean(ttfts):.3f} | "
                        f"{statistics.median(ttfts):.3f} | {pct(ttfts, 0.9):.3f} | {statistics.mean(rates):.1f} |")
        st = await engine.stats()
        emit(lines)
        emit(lines, f"engine stats at the end: encoder_cache_hits {st['encoder_cache_hits']}, misses "
                    f"{st['encoder_cache_misses']}, entries {st['encoder_cache_entries']}, evictions "
                    f"{st['encoder_cache_evictions']}")
    emit(lines, f"load average at the end: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    return lines


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="an Idefics3 (SmolVLM) folder; default: the tiny random one")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--width", type=int, default=100)
    ap.add_argument("--height", type=int, default=150)
    ap.add_argument("--step-tokens", type=int, default=512, help="max_num_batched_tokens")
    ap.add_argument("--kv-cache-tokens", type=int, default=32768)
    ap.add_argument("--encoder-cache-tokens", type=int, default=16384)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables, with provenance, here")
    args = ap.parse_args()
    from slipstream.logging_setup import configure_logging

    configure_logging("warning")
    if args.model is None:
        sys.path.insert(0, str(ROOT / "tests"))
        from idefics3_fixture import tiny_idefics3_folder

        model = str(tiny_idefics3_folder(Path(tempfile.mkdtemp(prefix="bench-idefics3-"))))
        weights = "random weights: the tiny Idefics3 of tests/idefics3_fixture.py"
    else:
        model, weights = args.model, "weights from the folder"
    report(lambda: asyncio.run(main(args, model, weights)), args.out)

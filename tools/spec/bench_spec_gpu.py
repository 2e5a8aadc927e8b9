"""Speculation against none at N streams, and its equality, in one process (issue 49's GPU table).

    python tools/spec/bench_spec_gpu.py [--device cuda] [--streams 1 8 32 128] [--out spec.md]

Two engines alive at once (the same model, dtype and KV size; depth 2): one without speculation, one
with `speculative={"method": "ngram"}` and the defaults (adaptive k). For each N and workload, N
requests at once on each engine, alternating off/on then on/off over the repeats; tokens/s = the
requests' tokens over the batch's wall time (first request sent to last token), median of the
repeats (mean and p90 beside it in the raw rows). Workloads (random weights loop back into text they
wrote, so greedy n-gram drafts are often right):
  repeat   greedy, a prompt that repeats a sentence
  code     greedy, a prompt that repeats a code line with changing numbers
  sampled  temperature 1 (seeded): with random weights nearly uniform, so drafts are (almost) never
           accepted: the workload where speculation must cost nothing
Acceptance: the speculating engine's accepted / fed drafts over that workload's batches.

Equality (`--equality`, on by default): float32 engines off/on, greedy, N = 8: sequences whose tokens
differ (must be 0); in the run's dtype, the share of sequences that differ with vs without
speculation beside the share that differ between the same prompts run alone (N = 1) and together
(N = 8) without it: the batch composition's own effect.

Without CUDA it runs the same on the CPU (`--device cpu --model tiny-random`: a dry run of the stage).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

from provenance import header  # noqa: E402

from slipstream import Engine, EngineConfig, SamplingParams  # noqa: E402

PROMPTS = {
    "repeat": lambda i: "the cat sat on the mat and looked at the door. " * 6 + f"({i})",
    "code": lambda i: "".join(f"x{j} = compute(x{j - 1}, {i + j})\n" for j in range(1, 13)),
    "sampled": lambda i: f"Tell me something new, number {i}.",
}


def params(workload: str, max_tokens: int, i: int) -> SamplingParams:
    if workload == "sampled":
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def config(args, speculative: bool, dtype: str | None = None) -> EngineConfig:
    kw = dict(model=args.model, device=args.device, pipeline_depth=2, max_batch_size=max(args.streams),
              kv_cache_tokens=args.kv_tokens)
    if dtype or args.dtype:
        kw["dtype"] = dtype or args.dtype
    if speculative:
        kw["speculative"] = {"method": "ngram"}
    return EngineConfig(**kw)


async def batch(engine: Engine, workload: str, n: int, max_tokens: int):
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.complete(PROMPTS[workload](i), params(workload, max_tokens, i))
                                  for i in range(n)))
    dt = time.perf_counter() - t0
    return [o.token_ids for o in outs], sum(len(o.token_ids) for o in outs) / dt


def spec_counts(stats: dict) -> tuple[int, int]:
    s = stats.get("speculative") or {}
    return s.get("drafted", 0), s.get("accepted", 0)


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def speed(args, lines: list[str]) -> None:
    lines += ["| N | workload | off tok/s | on tok/s | ratio | acceptance |", "|---|---|---:|---:|---:|---:|"]
    raw = ["", "Raw (tok/s per repeat, off then on; mean, p90 of each):", ""]
    async with Engine(config(args, False)) as off, Engine(config(args, True)) as on:
        for engine in (off, on):  # warm-up: every bucket the runs use, both workload kinds
            for n in args.streams:
                await batch(engine, "repeat", n, 8)
        for n in args.streams:
            for workload in args.workloads:
                rates: dict[str, list[float]] = {"off": [], "on": []}
                d0, a0 = spec_counts(await on.stats())
                for r in range(args.repeats):
                    order = (("off", off), ("on", on)) if r % 2 == 0 else (("on", on), ("off", off))
                    for name, engine in order:
                        rates[name].append((await batch(engine, workload, n, args.max_tokens))[1])
                d1, a1 = spec_counts(await on.stats())
                m_off, m_on = statistics.median(rates["off"]), statistics.median(rates["on"])
                acc = f"{(a1 - a0) / (d1 - d0):.2f}" if d1 > d0 else "no drafts"
                lines.append(f"| {n} | {workload} | {m_off:,.0f} | {m_on:,.0f} | {m_on / m_off:.3f} | {acc} |")
                raw.append(f"- N={n} {workload}: off {[round(x) for x in rates['off']]} "
                           f"(mean {statistics.mean(rates['off']):,.0f}, p90 {pct(rates['off'], 0.9):,.0f}); "
                           f"on {[round(x) for x in rates['on']]} (mean {statistics.mean(rates['on']):,.0f}, "
                           f"p90 {pct(rates['on'], 0.9):,.0f}); drafts fed {d1 - d0}, accepted {a1 - a0}")
                print(lines[-1], flush=True)
        st = await on.stats()
        raw.append(f"- the speculating engine at the end: eager_steps {st.get('eager_steps')} of {st['steps']} steps, "
                   f"speculative {st.get('speculative')}")
        st = await off.stats()
        raw.append(f"- the plain engine at the end: eager_steps {st.get('eager_steps')} of {st['steps']} steps")
    lines += raw


def differ(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x != y for x, y in zip(a, b))


async def equality(args, lines: list[str]) -> None:
    n, tokens = 8, args.max_tokens
    lines += ["", f"Equality (greedy, N = {n}, {tokens} tokens, workloads repeat and code):", ""]
    async with Engine(config(args, False, "float32")) as off, Engine(config(args, True, "float32")) as on:
        for workload in ("repeat", "code"):
            base, _ = await batch(off, workload, n, tokens)
            got, _ = await batch(on, workload, n, tokens)
            lines.append(f"- float32, {workload}: {differ(base, got)} of {n} sequences differ with vs without speculation")
    dtype = args.dtype or "the default dtype"
    async with Engine(config(args, False)) as off, Engine(config(args, True)) as on:
        for workload in ("repeat", "code"):
            together, _ = await batch(off, workload, n, tokens)
            alone = [(await off.complete(PROMPTS[workload](i), params(workload, tokens, i))).token_ids
                     for i in range(n)]
            spec, _ = await batch(on, workload, n, tokens)
            lines.append(f"- {dtype}, {workload}: with vs without speculation {differ(together, spec)}/{n} differ; "
                         f"without it, alone (N = 1) vs together (N = 8) {differ(together, alone)}/{n} differ")
    print("\n".join(lines[-6:]), flush=True)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random-smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="'' for the device's default")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--workloads", nargs="+", default=list(PROMPTS), choices=list(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=65536)
    ap.add_argument("--no-equality", dest="equality", action="store_false")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines = [header(" ".join(sys.argv)), ""]
    t0 = time.perf_counter()
    await speed(args, lines)
    if args.equality:
        await equality(args, lines)
    lines.append(f"\n({time.perf_counter() - t0:.0f} s)")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    asyncio.run(main())

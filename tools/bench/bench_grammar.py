"""Constrained decoding under pipelining: throughput and period at 0/50/100% constrained requests.

    python tools/bench/bench_grammar.py [--model smollm2-135m] [--streams 16] [--len 24] [--repeats 3]

Workload: N concurrent streams, short prompts, exactly L output tokens each. Constrained streams
use the regex `[0-9]{L}` (llguidance; SmolLM2 writes one digit per token, so the grammar ends at
exactly L tokens and its mask is rebuilt from committed state every step); unconstrained streams
use ignore_eos with max_tokens=L. Each repeat runs every (fraction, depth) back to back in one
process, and ratios are taken within a repeat (this machine's speed drifts between repeats by more
than the effects measured); the table shows medians over repeats of the values and of the ratios.
`mask ms/step` is host time spent building masks per step.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import os as _os
import sys as _sys

_sys.path.insert(0, _os.path.dirname(_os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))))  # this checkout

from slipstream import Engine, EngineConfig, SamplingParams  # noqa: E402
from slipstream.logging_setup import configure_logging  # noqa: E402


async def run_once(model: str, depth: int, streams: int, length: int, fraction: float) -> dict:
    config = EngineConfig(model=model, pipeline_depth=depth, max_batch_size=streams, trace=True)
    n_constrained = round(streams * fraction)
    async with Engine(config) as engine:
        prompt = await engine.chat_prompt([{"role": "user", "content": "Write a long number."}])
        await engine.complete(prompt, SamplingParams(max_tokens=2, temperature=0.0, regex="[0-9]{2}"))  # warm up
        loop = engine.loop
        tracer = engine.tracer
        tracer.clear()
        steps0, mask0 = loop.num_steps, loop.constraints.mask_build_s
        params = [SamplingParams(max_tokens=length, temperature=0.0, regex=f"[0-9]{{{length}}}")
                  if i < n_constrained else SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
                  for i in range(streams)]
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.complete(prompt, p) for p in params))
        wall = time.perf_counter() - t0
        assert all(len(o.token_ids) == length for o in outs), [len(o.token_ids) for o in outs]
        starts = [s.start for s in tracer.spans if s.label == "forward"]
        periods = [b - a for a, b in zip(starts, starts[1:])]
        steps = loop.num_steps - steps0
        return {"tok_s": streams * length / wall, "period_ms": statistics.median(periods) * 1e3,
                "mask_ms": (loop.constraints.mask_build_s - mask0) / max(steps, 1) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--len", type=int, default=24, dest="length")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from slipstream.provenance import header, provenance  # noqa: E402

    print(header(provenance()), flush=True)
    configure_logging("warning")
    rows = {}
    fractions = (0.0, 0.5, 1.0)
    for rep in range(args.repeats):
        for fraction in fractions:
            for depth in (1, 2):
                r = asyncio.run(run_once(args.model, depth, args.streams, args.length, fraction))
                rows.setdefault((fraction, depth), []).append(r)
                print(f"  rep={rep + 1} constrained={fraction:.0%} depth={depth}: {r['tok_s']:.1f} tok/s", flush=True)
    for (fraction, depth), runs in rows.items():  # ratios within each repeat
        for i, r in enumerate(runs):
            r["rel"] = r["tok_s"] / rows[(0.0, depth)][i]["tok_s"]
            r["d21"] = r["tok_s"] / rows[(fraction, 1)][i]["tok_s"]
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("tok_s", "period_ms", "mask_ms", "rel", "d21")}
           for k, v in rows.items()}
    print(f"\nmodel={args.model} streams={args.streams} L={args.length} repeats={args.repeats} (medians)\n")
    print("| constrained | depth | tokens/s | period ms | mask build ms/step | vs 0% at same depth | d2/d1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for fraction in fractions:
        for depth in (1, 2):
            m = med[(fraction, depth)]
            d21 = f"{m['d21']:.3f}" if depth == 2 else ""
            print(f"| {fraction:.0%} | {depth} | {m['tok_s']:.1f} | {m['period_ms']:.1f} | {m['mask_ms']:.3f} | "
                  f"{m['rel']:.3f} | {d21} |")
    ratios = " ".join(f"{r['rel']:.3f}" for r in rows[(1.0, 2)])
    print(f"\n100% constrained / 0% at depth 2, per repeat: {ratios}")


if __name__ == "__main__":
    main()

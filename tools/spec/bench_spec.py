"""Batch-1 decode speed with and without speculative decoding, interleaved in one run.

    python tools/spec/bench_spec.py [--model smollm2-135m] [--max-tokens 192] [--repeats 3] [--out FILE]

Two engines in one process (the default model and EngineConfig, depth 2; one with
`speculative=SpeculativeConfig(...)`), each request alone (batch 1, greedy) on the chat workloads
of tools/spec/spec_workloads.py. Order per repeat: for each workload, off then on, then the next
repeat reverses it (A/B, B/A). Per request: decode tokens per second of wall time (first token to
last, so the prompt's forward is left out) and of process CPU time (both engine threads; the
machine is shared). The speedup is the ratio of medians, workload by workload. Also the
acceptance (drafts accepted / fed) and whether the two outputs are the same tokens (without batch
invariance a k + 1-position forward may round a near-tie the other way: docs/speculative.md).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1] / "common")]  # spec_workloads, the shared helpers

from provenance import header  # noqa: E402
from spec_workloads import WORKLOADS  # noqa: E402

from slipstream import Engine, EngineConfig, SamplingParams  # noqa: E402
from slipstream.params import SpeculativeConfig  # noqa: E402


async def one(engine: Engine, message: str, max_tokens: int, raw: bool = False):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    c0 = time.process_time()
    if raw:
        out = await engine.complete(message, params)
    else:
        out = await engine.chat([{"role": "user", "content": message}], params)
    cpu = time.process_time() - c0
    times = out.metrics.token_times
    n = len(out.token_ids)
    return out.token_ids, (n - 1) / (times[-1] - times[0]), n / cpu


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-drafts", type=int, default=4)
    ap.add_argument("--fixed", action="store_true", help="always num_drafts drafts (no adaptive k)")
    ap.add_argument("--method", default="ngram", choices=["ngram", "draft"])
    ap.add_argument("--draft-model", default=None, help="with --method draft")
    ap.add_argument("--raw", action="store_true",
                    help="send each workload's text as a raw prompt, not a chat message (models without a chat "
                         "template, e.g. the random ones)")
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--activations", nargs="+", default=["float"], choices=["auto", "int8", "int16", "float"],
                    help="EngineConfig.activations; several: an off/on pair of engines each, interleaved, one table each")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines = [header(" ".join(sys.argv))]

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line + "\n")

    spec = SpeculativeConfig(method=args.method, num_drafts=args.num_drafts, adaptive=not args.fixed,
                             draft_model=args.draft_model)
    emit(f"model={args.model} max_tokens={args.max_tokens} repeats={args.repeats} speculative={spec}")
    engines = {}
    for act in args.activations:
        engines[act, "off"] = Engine(EngineConfig(model=args.model, activations=act))
        engines[act, "on"] = Engine(EngineConfig(model=args.model, activations=act, speculative=spec))
    for e in engines.values():
        await e.start()
    try:
        for name in engines:  # warm-up: kernels, caches, the first allocation of everything
            await one(engines[name], "Say hello.", 16, args.raw)
        wall: dict = {(w, s): [] for w in args.workloads for s in engines}
        cpu: dict = {(w, s): [] for w in args.workloads for s in engines}
        same: dict = {(w, a): [] for w in args.workloads for a in args.activations}
        accepted: dict = {(w, a): [0, 0, 0] for w in args.workloads for a in args.activations}
        for r, w, act in ((r, w, act) for r in range(args.repeats) for w in args.workloads for act in args.activations):
            order = ((act, "off"), (act, "on")) if r % 2 == 0 else ((act, "on"), (act, "off"))
            outs = {}
            for side in order:
                stats0 = (await engines[side].stats()).get("speculative")
                ids, tps, cps = await one(engines[side], WORKLOADS[w][1], args.max_tokens, args.raw)
                stats1 = (await engines[side].stats()).get("speculative")
                if stats1:
                    for i, key in enumerate(("accepted", "drafted", "steps")):
                        accepted[w, act][i] += stats1[key] - stats0[key]
                outs[side[1]] = ids
                wall[w, side].append(tps)
                cpu[w, side].append(cps)
                emit(f"repeat {r} {w:12s} {act:5s} {side[1]:3s} tokens={len(ids):4d} wall tok/s={tps:7.1f} "
                     f"cpu tok/s={cps:7.1f}")
            same[w, act].append(outs["off"] == outs["on"])
        for act in args.activations:
            emit(f"\nactivations={act}\n")
            emit("| workload | repeats its input | off: tok/s wall (median / mean / p90-low) | on: tok/s wall (median / mean / p90-low) "
                 "| speedup, wall | speedup, CPU time | drafts accepted / fed | same tokens |")
            emit("|---|---|---:|---:|---:|---:|---:|---|")
            for w in args.workloads:
                off, on = wall[w, (act, "off")], wall[w, (act, "on")]
                a, d, _ = accepted[w, act]
                emit(f"| {w} | {'yes' if WORKLOADS[w][0] else 'no'} "
                     f"| {statistics.median(off):.1f} / {statistics.mean(off):.1f} / {pct(off, 0.1):.1f} "
                     f"| {statistics.median(on):.1f} / {statistics.mean(on):.1f} / {pct(on, 0.1):.1f} "
                     f"| {statistics.median(on) / statistics.median(off):.2f} "
                     f"| {statistics.median(cpu[w, (act, 'on')]) / statistics.median(cpu[w, (act, 'off')]):.2f} "
                     f"| {a} / {d} ({a / d if d else 0:.2f}) | {sum(same[w, act])}/{len(same[w, act])} |")
        emit(f"\nload average at the end: {os.getloadavg()}; cpu tok/s: tokens / process CPU seconds of the "
             "whole request (prefill included); wall tok/s: decode only (first token to last)")
    finally:
        for e in engines.values():
            await e.close()
    if args.out is not None:
        args.out.write_text("".join(lines))


if __name__ == "__main__":
    asyncio.run(main())

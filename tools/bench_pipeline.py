"""Blocking (depth 1) vs pipelined (depth 2) decode, same process, Photon-style table.

    python tools/bench_pipeline.py [--models smollm2-135m tiny-random] [--streams 1 8 32] [--len 32]
                                   [--repeats 3] [--json out.json]

Each (model, streams) pair runs depth 1 and depth 2 alternately `repeats` times; the table shows
the run with the median throughput of each depth (steady-state step medians inside each run).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

from slipstream.bench import format_table, run_once, to_json
from slipstream.logging_setup import configure_logging


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "tiny-random"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--len", type=int, default=32, dest="output_len")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    configure_logging("warning")
    results = []
    for model in args.models:
        for n in args.streams:
            runs = {1: [], 2: []}
            for rep in range(args.repeats):
                for depth in (1, 2):
                    r = asyncio.run(run_once(model, args.device, depth, n, args.output_len))
                    runs[depth].append(r)
                    print(f"  {model} streams={n} depth={depth} rep={rep}: {r.tokens_per_s:.1f} tok/s, "
                          f"period {r.steady.period_ms:.2f} ms", file=sys.stderr, flush=True)
            for depth in (1, 2):
                med = statistics.median_low([r.tokens_per_s for r in runs[depth]])
                results.append(next(r for r in runs[depth] if r.tokens_per_s == med))
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(results), f, indent=2)


if __name__ == "__main__":
    main()

"""`slipstream bench`: blocking vs pipelined decode in one process (see slipstream/bench.py)."""
from __future__ import annotations

import asyncio
import json
import statistics
import sys


def register(sub) -> None:
    p = sub.add_parser("bench", help="depth 1 vs depth 2 decode benchmark, Photon-style table")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--len", type=int, default=32, dest="output_len", help="output tokens per stream (ignore_eos)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    from slipstream.bench import format_table, run_once, to_json

    results = []
    for n in args.streams:
        runs = {1: [], 2: []}
        for rep in range(args.repeats):
            for depth in (1, 2):  # alternate, so drift affects both depths alike
                r = asyncio.run(run_once(args.model, args.device, depth, n, args.output_len))
                runs[depth].append(r)
                print(f"  streams={n} depth={depth} rep={rep + 1}/{args.repeats}: {r.tokens_per_s:.1f} tok/s, "
                      f"period {r.steady.period_ms:.2f} ms", file=sys.stderr, flush=True)
        for depth in (1, 2):
            med = statistics.median_low([r.tokens_per_s for r in runs[depth]])
            results.append(next(r for r in runs[depth] if r.tokens_per_s == med))
    print(json.dumps(to_json(results), indent=2) if args.json else format_table(results))
    return 0

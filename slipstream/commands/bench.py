"""`slipstream bench`: blocking vs pipelined decode in one process, Photon-style tables.

Prints (a) forward / sampling / period per step and (b) blocking vs pipelined step time with the
cost model's predicted speedup next to the observed one (see slipstream/bench.py for both).
Progress goes to stderr; `--json` prints a machine-readable document on stdout.
"""
from __future__ import annotations

import asyncio
import datetime
import json
import sys

from slipstream.params import EVENT_WAITS

from slipstream.cli import add_log_args


def register(sub) -> None:
    p = sub.add_parser("bench", help="depth 1 vs depth 2 decode benchmark, Photon-style tables")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="concurrent streams (one run each)")
    p.add_argument("--len", type=int, default=32, dest="output_len", help="output tokens per stream (ignore_eos)")
    p.add_argument("--event-wait", default="auto", choices=EVENT_WAITS,
                   help="how the loop awaits CUDA events (see docs/cuda.md); ignored on the CPU")
    p.add_argument("--repeats", type=int, default=3, help="runs per depth and stream count (medians reported)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    p.add_argument("--json-out", metavar="PATH", help="also write the JSON document to PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_log_args(p)
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    from tqdm import tqdm

    from slipstream.bench import bench, format_tables, machine, to_json

    if min(args.streams) < 1 or args.output_len < 2 or args.repeats < 1:
        print("slipstream bench: --streams >= 1, --len >= 2 and --repeats >= 1", file=sys.stderr)
        return 2
    # one unit per committed step: a run is one prefill step and L − 1 decode steps
    total = 2 * args.repeats * args.output_len * len(args.streams)
    bar = tqdm(total=total, unit="step", file=sys.stderr, disable=args.no_progress or None, dynamic_ncols=True)

    def on_run(n, depth, rep, wall, steady) -> None:
        bar.set_postfix_str(f"streams={n} depth={depth}")
        msg = (f"  streams={n} depth={depth} rep={rep + 1}/{args.repeats}: wall {wall:.3f} s, "
               f"period {steady.period_ms:.2f} ms, idle {steady.idle_ms:.2f} ms")
        if bar.disable:
            print(msg, file=sys.stderr, flush=True)
        else:
            bar.write(msg, file=sys.stderr)

    started = datetime.datetime.now().astimezone()
    try:
        rows = asyncio.run(bench(args.model, args.device, args.streams, args.output_len, args.repeats,
                                 on_step=lambda step: bar.update(1), on_run=on_run, dtype=args.dtype,
                                 event_wait=args.event_wait))
    finally:
        bar.close()
    meta = {"command": "slipstream " + " ".join(sys.argv[1:]), "date": started.isoformat(timespec="seconds"),
            "model": args.model, "device": args.device, "dtype": args.dtype, "event_wait": args.event_wait,
            "repeats": args.repeats, **machine()}
    doc = json.dumps(to_json(rows, meta), indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(doc + "\n")
    if args.json:
        print(doc)
    else:
        print(f"model {args.model} ({args.dtype}) on {args.device}, L={args.output_len}, {args.repeats} repeat(s), "
              f"{started:%Y-%m-%d %H:%M %Z}\n")
        print(format_tables(rows))
    return 0

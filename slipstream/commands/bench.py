"""`slipstream bench`: blocking vs pipelined decode in one process, Photon-style tables.

Prints a provenance header, then (a) per-step times with period and device idle as median / mean /
p90, (b) the depth-2 period and speedup predicted from each repeat's depth-1 run before its depth-2
run (also printed to stderr as it is made), against the measured ones, and (c) the accounting
identity (slipstream/bench.py). Warns when repeats disagree by more than the effect reported.
Progress goes to stderr; `--json` prints a machine-readable document on stdout.
"""
from __future__ import annotations

import asyncio
import datetime
import json
import sys

from slipstream.runtime.devices.event_waits import EVENT_WAITS

from slipstream.cli import add_log_args, add_model_args, add_num_drafts_arg, speculative_config
from slipstream.errors import InvalidRequestError


def register(sub) -> None:
    p = sub.add_parser("bench", help="depth 1 vs depth 2 decode benchmark, Photon-style tables")
    add_model_args(p)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32], help="concurrent streams (one run each)")
    p.add_argument("--len", type=int, default=32, dest="output_len", help="output tokens per stream (ignore_eos)")
    p.add_argument("--event-wait", default="auto", choices=EVENT_WAITS,
                   help="how the loop awaits CUDA events (see docs/cuda.md); ignored on the CPU")
    p.add_argument("--repeats", type=int, default=3, help="runs per depth and stream count (medians reported)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the tables")
    p.add_argument("--json-out", metavar="PATH", help="also write the JSON document to PATH")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--speculative", default=None, choices=["ngram"],
                   help="both depths with n-gram speculative decoding (docs/speculative.md; tools/spec/bench_spec.py "
                        "compares with it off)")
    add_num_drafts_arg(p)
    add_log_args(p)
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    from tqdm import tqdm

    from slipstream.bench import bench
    from slipstream.bench_report import format_tables, notes, to_json
    from slipstream.provenance import header, provenance

    if min(args.streams) < 1 or args.output_len < 2 or args.repeats < 1:
        raise InvalidRequestError("bench: need --streams >= 1, --len >= 2 and --repeats >= 1")
    spec = speculative_config(args)  # (validates --num-drafts, refuses it without --speculative)
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

    def on_predict(n, rep, p) -> None:
        msg = (f"  streams={n} rep={rep + 1}: predicted before depth 2 ran (from depth 1 alone): period "
               f"{p.period_ms:.2f} ms ({p.bound}-bound: busy {p.busy_ms:.2f}, host {p.host_ms:.2f}), "
               f"speedup {100 * (p.speedup - 1):+.1f}%")
        if bar.disable:
            print(msg, file=sys.stderr, flush=True)
        else:
            bar.write(msg, file=sys.stderr)

    started = datetime.datetime.now().astimezone()
    prov = provenance(["slipstream", *args.argv])
    try:
        rows = asyncio.run(bench(args.model, args.device, args.streams, args.output_len, args.repeats,
                                 on_step=lambda step: bar.update(1), on_run=on_run, dtype=args.dtype,
                                 event_wait=args.event_wait, on_predict=on_predict, speculative=spec))
    finally:
        bar.close()
    if args.json:  # (the tables carry it in their notes: said once either way)
        for line in notes(rows, args.device):
            print(line, file=sys.stderr)
    meta = {"provenance": prov, "model": args.model, "device": args.device, "dtype": args.dtype,
            "speculative": args.speculative, "num_drafts": spec.num_drafts if spec else None,
            "event_wait": args.event_wait, "repeats": args.repeats, "output_len": args.output_len}
    doc = json.dumps(to_json(rows, meta), indent=2)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(doc + "\n")
    if args.json:
        print(doc)
    else:
        print(header(prov))
        print(f"model {args.model} ({args.dtype}) on {args.device}, L={args.output_len}, {args.repeats} repeat(s), "
              f"{started:%Y-%m-%d %H:%M %Z}\n")
        print(format_tables(rows, args.device))
    return 0

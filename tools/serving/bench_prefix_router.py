"""Cost of the prefix-aware routing policy per request (slipstream.serve.prefix_router), no Ray.

    python tools/serving/bench_prefix_router.py [--tokens 2048] [--page-size 16] [--repeats 5] [--out FILE]

Times block_hashes on one prompt, PrefixTable.record / longest_match of its chain and choose()
over 8 replicas, and the table's memory per entry; median, mean and p90 over repeats (each repeat
the mean of 200 calls). The figures behind docs/scale-out.md's router sizing.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import timeit
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))  # the shared helpers
from provenance import header  # noqa: E402

from slipstream.serve.prefix_router import PrefixTable, block_hashes, choose  # noqa: E402


def _p90(xs):
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    ids = [rng.randrange(50_000) for _ in range(args.tokens)]
    chain = block_hashes(ids, args.page_size)
    table = PrefixTable(1 << 20)
    replicas = [f"r{i}" for i in range(8)]
    for i in range(2000):  # a warm table: other prompts' chains spread over the replicas
        table.record(block_hashes([i] + ids[1:], args.page_size), replicas[i % 8])
    table.record(chain, "r3")
    queues = {r: rng.randrange(4) for r in replicas}
    ops = {
        f"block_hashes ({args.tokens} tokens, page {args.page_size})": lambda: block_hashes(ids, args.page_size),
        f"PrefixTable.record ({len(chain)} hashes)": lambda: table.record(chain, "r3"),
        f"PrefixTable.longest_match ({len(chain)} hashes)": lambda: table.longest_match(chain, set(replicas)),
        "choose (8 replicas, chain given)": lambda: choose(chain, replicas, queues.get, table, key=lambda r: r,
                                                           imbalance_threshold=8),
    }
    rows = []
    for name, fn in ops.items():
        us = [timeit.timeit(fn, number=200) / 200 * 1e6 for _ in range(args.repeats)]
        rows.append(f"| {name} | {statistics.median(us):.1f} | {statistics.mean(us):.1f} | {_p90(us):.1f} |")
    tracemalloc.start()
    big = PrefixTable(1 << 20)
    for i in range(4096):
        big.record(block_hashes([i] * 16 * args.page_size, args.page_size), "r")
    per_entry = tracemalloc.get_traced_memory()[0] / len(big)
    tracemalloc.stop()
    text = "\n".join([header().rstrip("\n"), "", "| operation | µs median | mean | p90 |", "|---|---:|---:|---:|",
                      *rows, "", f"PrefixTable memory: {per_entry:.0f} bytes per entry ({len(big)} entries, "
                      "tracemalloc)"]) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The CPU's numpy paths of a speculating step against the torch paths other devices run, one call each.

    python tools/spec/bench_spec_cpu_paths.py [--repeats 2000] [--out FILE]

The n-gram proposal (`NgramDrafter`, one row, 600 tokens of history, window 1024, up to 4 drafts) and
greedy replay (`replay_accept`, one row, 4 drafts), numpy and torch alternating, one torch thread; CPU
time of the thread (thread_time) per call in µs: median, mean and p90 over 5 rounds of `--repeats` calls.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

import torch  # noqa: E402
from bench_lines import emit, pct, report  # noqa: E402

from slipstream.speculation.ngram_drafter import NgramDrafter  # noqa: E402
from slipstream.speculation.verify import _replay_accept_numpy, _replay_accept_torch, spec_layout  # noqa: E402
from slipstream.speculation.history import TokenHistory  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    seq = torch.tensor([rng.randrange(300) for _ in range(600)])
    history = TokenHistory(2, 2048)
    history.write_chunks(torch.ones_like(seq), torch.arange(len(seq)), seq, torch.tensor([1]), torch.tensor([len(seq)]))
    drafter, row = NgramDrafter(history, max_drafts=4, min_n=1, max_n=3, window=1024), torch.tensor([1])
    lay, targets, drafts = spec_layout([4], max_drafts=4), torch.tensor([5, 6, 7, 8, 9]), torch.tensor([[5, 6, 1, 2]])
    cases = {("n-gram proposal", "numpy"): lambda: drafter._propose_numpy(row),
             ("n-gram proposal", "torch"): lambda: drafter._propose_torch(row),
             ("greedy replay", "numpy"): lambda: _replay_accept_numpy(targets, drafts, lay),
             ("greedy replay", "torch"): lambda: _replay_accept_torch(targets, drafts, lay)}

    def body() -> list[str]:
        lines: list[str] = []
        times: dict = {c: [] for c in cases}
        for _ in range(5):
            for case, fn in cases.items():
                for _ in range(100):  # warm-up
                    fn()
                t0 = time.thread_time()
                for _ in range(args.repeats):
                    fn()
                times[case].append((time.thread_time() - t0) / args.repeats * 1e6)
        emit(lines, f"\n{args.repeats} calls x 5 rounds, torch threads 1; CPU µs per call\n")
        emit(lines, "| path | implementation | median | mean | p90 |")
        emit(lines, "|---|---|---:|---:|---:|")
        for (path, impl), ts in times.items():
            emit(lines, f"| {path} | {impl} | {statistics.median(ts):.1f} | {statistics.mean(ts):.1f} | {pct(ts, 0.9):.1f} |")
        return lines

    report(body, args.out)


if __name__ == "__main__":
    main()

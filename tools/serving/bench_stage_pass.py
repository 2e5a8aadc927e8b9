"""What one output-stage pass costs the loop, per request: the loop stage's text and delivery phases.

    python tools/serving/bench_stage_pass.py [--requests 32 128 512] [--passes 300]

N requests each get one token (OutputProcessor.accept, the tick), then one synchronous pass
(process_pending: snapshot, detokenise, emit) is timed; a trivial detokeniser, no stream reader.
Median / p90 of the passes after 50 warm-up ones, µs. No engine, no model: the stage's own Python.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's slipstream


class _Detok:
    def push(self, ids):
        return "x" * len(ids)

    def flush(self):
        return ""


def one(n: int, passes: int) -> list[float]:
    from slipstream import SamplingParams
    from slipstream.api.output_processor import OutputProcessor, RequestState
    from slipstream.outputs import RequestMetrics
    from slipstream.runtime.batch import SamplingRow
    from slipstream.scheduler.sequence import Sequence

    proc = OutputProcessor()
    proc.bind(lambda seq, reason: True)
    reqs = []
    for i in range(n):
        params = SamplingParams(max_tokens=1_000_000, ignore_eos=True)
        req = RequestState(f"r{i}", [1], params, _Detok(), frozenset(), RequestMetrics(0.0), streaming=False)
        reqs.append((req, Sequence(f"r{i}", [1], 1_000_000, SamplingRow(), user=req)))
    times = []
    for _ in range(passes):
        for req, seq in reqs:
            proc.accept(seq, 5)
        t0 = time.perf_counter()
        proc.process_pending()
        times.append(time.perf_counter() - t0)
        for req, _ in reqs:
            req.pieces.clear()
    return times[50:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--passes", type=int, default=300)
    args = ap.parse_args(argv)
    from slipstream.provenance import header, provenance

    print(header(provenance()), flush=True)
    print("| requests | pass median µs | p90 µs | median per request µs |\n|---:|---:|---:|---:|")
    for n in args.requests:
        t = sorted(one(n, args.passes))
        med, p90 = statistics.median(t) * 1e6, t[int(0.9 * (len(t) - 1))] * 1e6
        print(f"| {n} | {med:.0f} | {p90:.0f} | {med / n:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

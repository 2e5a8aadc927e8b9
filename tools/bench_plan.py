"""Planner.plan() alone: N running sequences all decoding, the median of 7 rounds of 200 plans.

    python tools/bench_plan.py 256

The decode-row choice is the scheduler's per-row hot loop (scheduler/decode_rows.py); this isolates
it from the rest of the step, which tools/bench_host.py measures whole.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the slipstream of this checkout

from slipstream.runtime.batch import SamplingRow  # noqa: E402
from slipstream.scheduler.page_pool import PagePool  # noqa: E402
from slipstream.scheduler.planner import Planner  # noqa: E402
from slipstream.scheduler.sequence import Sequence, SeqStatus  # noqa: E402


def main(n: int) -> None:
    planner = Planner(PagePool(n * 8 + 1), 16, n, 8192)
    for i in range(n):
        s = Sequence(f"s{i}", list(range(3, 11)), 10_000, SamplingRow(), output_ids=[5])
        s.status, s.row, s.pages = SeqStatus.RUNNING, i + 1, planner.pool.allocate(1)
        s.num_scheduled, s.pending_samples, s.inflight_refs, s.last_token_on_device = 9, 1, 1, True
        planner.running.append(s)
    rounds = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(200):
            step = planner.plan(2)
        rounds.append((time.perf_counter() - t0) / 200)
    assert step is not None and len(step.decode) == n
    print(f"N={n} plan() median {sorted(rounds)[3] * 1e6:.1f} µs, min {min(rounds) * 1e6:.1f} µs")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)

"""Planner.plan() alone: N running sequences all decoding, the median of 7 rounds of 200 plans; or
the time to cancel N waiting requests (O(N): admission.py's lazy deletion; a deque.remove each
took seconds at 40,000, tests/test_planner_fairness.py checks the mechanism).

    python tools/bench/bench_plan.py 256
    python tools/bench/bench_plan.py --cancel 40000

The decode-row choice is the scheduler's per-row hot loop (scheduler/decode_rows.py); this isolates
it from the rest of the step, which tools/bench/bench_host.py measures whole.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout

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


def cancel(n: int) -> None:
    from slipstream.scheduler.pipeline import Pipeline

    planner = Planner(PagePool(64), 4, 4, 16)
    pipeline = Pipeline(2, planner)
    seqs = [Sequence(f"w{i}", [3, 4, 5, 6], 8, SamplingRow()) for i in range(n)]
    for s in seqs:
        planner.add(s)
    t0 = time.perf_counter()
    for s in reversed(seqs):  # newest first: a deque.remove would scan the whole queue each time
        pipeline.finish(s, "abort")
    elapsed = time.perf_counter() - t0
    assert planner.num_waiting == 0 and planner.plan(2) is None
    print(f"{n} waiting requests cancelled in {elapsed * 1e3:.1f} ms ({elapsed / n * 1e6:.2f} µs each)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cancel"]:
        cancel(int(sys.argv[2]) if len(sys.argv) > 2 else 40_000)
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 256)

"""tools/soak/soak.py with a host-side trace of the device's page tables (no device reads).

    PYTHONPATH=$PWD python docs/results/images-2026-11-25/debug/soak_trace.py --requests 4000 --rounds 2 --seed 3

Wraps EngineLoop.launch / _recover of the soaked (depth-2) engine only:
  * a host mirror of the runner's page table, written with each launched step's page_writes;
  * at a failed step, the writes of the steps whose forward never ran (an injected forward fault
    at step N: N and later; a sample fault at N: the forward of N ran, later ones were skipped by
    the sticky stream) are rolled back in the mirror: the device never got them. Each lost write
    whose row belongs to a live sequence that is in none of the failed steps is traced ("LOST");
  * at every launch, the live sequences whose entries the step carries without carrying them
    ("ORPHAN": admitted in this plan, no chunk: the encoder budget cut it at an image);
  * at every launch, each sequence of the step whose page row in the mirror differs from its
    Sequence.pages is traced ("STALE"), with the live sequences that own the page the device has.
Costs a few dict operations per sequence per step; the trace is printed after the soak's report.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tools" / "soak"))
sys.path.insert(0, str(ROOT))

import soak  # noqa: E402
from slipstream.scheduler.engine_loop import EngineLoop  # noqa: E402

TRACE: list[tuple] = []
DEV: dict[tuple[int, int], int] = {}  # (row, index) -> page, as the device's table has it
UNDO: dict[int, list[tuple[tuple[int, int], int | None]]] = {}  # step id -> previous values
_launch, _recover = EngineLoop.launch, EngineLoop._recover


def launch(self, step):
    if self.depth != 2:
        return _launch(self, step)
    step = _launch(self, step)
    w = step.page_writes
    undo = UNDO[step.step_id] = []
    for i in range(0, len(w), 3):
        key = (w[i], w[i + 1])
        undo.append((key, DEV.get(key)))
        DEV[key] = w[i + 2]
    rows = {q.row for q in step.seqs}
    orphans = {q.request_id for q in self.planner.running if q.row in set(w[::3]) - rows}
    if orphans:  # entries for live sequences this step does not carry (admitted without a chunk)
        TRACE.append(("ORPHAN", step.step_id, sorted(orphans)))
    for seq in step.seqs:
        bad = [(j, DEV.get((seq.row, j)), p) for j, p in enumerate(seq.pages) if DEV.get((seq.row, j)) != p]
        if bad:
            owners = {q.request_id: q.pages for q in self.planner.running if q is not seq and not q.finished}
            hit = {rid: sorted(set(pages) & {d for _, d, _ in bad}) for rid, pages in owners.items()}
            TRACE.append(("STALE", step.step_id, seq.request_id, seq.row, bad,
                          {rid: p for rid, p in hit.items() if p}))
    for sid in [s for s in UNDO if s < step.step_id - 4]:
        del UNDO[sid]
    return step


async def recover(self, failed, error):
    if self.depth != 2:
        return await _recover(self, failed, error)
    steps = list(self.pipeline.inflight)
    m = re.search(r"injected (\w+) fault \(at (\d+)\)", repr(error))
    first_lost = int(m.group(2)) + (m.group(1) == "sample") if m else failed.step_id
    members = {id(q) for s in steps for q in s.seqs}
    holders = {q.row: q for q in self.planner.running}
    for s in reversed(steps):
        if s.step_id < first_lost:
            continue
        for key, old in reversed(UNDO.get(s.step_id, [])):
            if old is None:
                DEV.pop(key, None)
            else:
                DEV[key] = old
        w = s.page_writes
        for i in range(0, len(w), 3):
            q = holders.get(w[i])
            if q is not None and id(q) not in members and not q.finished:
                TRACE.append(("LOST", s.step_id, q.request_id, w[i], w[i + 1], w[i + 2], repr(error)[:60]))
    TRACE.append(("FAILED", failed.step_id, [s.step_id for s in steps], first_lost))
    return await _recover(self, failed, error)


EngineLoop.launch, EngineLoop._recover = launch, recover


def main() -> int:
    import argparse

    import uvloop

    from slipstream.logging_setup import configure_logging

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--fault-scale", type=float, default=1.0, help="forward/sample fault rates times this")
    args = ap.parse_args()
    rates = dict(soak.FAULT_RATES)
    for point in ("forward", "sample"):
        rates[point] *= args.fault_scale
    soak.use_images(args.seed)
    configure_logging("error")
    report = uvloop.run(soak.soak(args.requests, args.rounds, args.seed, rates))
    print(soak.format_report(report))
    for line in TRACE:
        print(*line)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())

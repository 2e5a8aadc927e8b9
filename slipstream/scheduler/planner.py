"""Plan: choose the next step's batch (continue, admit, chunk prefill, preempt).

Pure Python; sees only sequences and page counts. Rules:
  * A sequence is planned only while not finalized, not being preempted, and with fewer than
    `depth` steps in flight (so inflight_refs never exceeds the pipeline depth).
  * Decode inputs come from the device (SeqWork.tokens is None); host-known tokens (prompt chunks,
    or a committed token whose KV is not yet computed) are sent as a chunk.
  * No sample is scheduled beyond max_tokens (counting samples still in flight), so a length cap
    never creates a zombie; only EOS/stop/abort do.
  * Pages are reserved before launch. A running sequence that cannot grow makes the most recently
    admitted unplanned sequence (possibly itself) a preemption victim; its pages return to the
    pool when its inflight_refs reaches 0 and it is recomputed from its known tokens.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from slipstream.runtime.batch import SeqWork
from slipstream.scheduler.page_pool import PagePool
from slipstream.scheduler.sequence import Sequence, SeqStatus


@dataclass
class PlannedStep:
    works: list[SeqWork]
    seqs: list[Sequence]

    @property
    def kind(self) -> str:
        prefill = any(w.tokens is not None for w in self.works)  # prompt or recompute chunks
        return "prefill" if prefill else "decode"

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.works)


class Planner:
    def __init__(self, pool: PagePool, page_size: int, max_batch_size: int, max_step_tokens: int):
        self.pool, self.page_size = pool, page_size
        self.max_batch_size, self.max_step_tokens = max_batch_size, max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted (holding a row), in admission order
        self._free_rows = list(range(max_batch_size, 0, -1))  # row 0 is never used
        self.num_preemptions = 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not s.finalized for s in self.running)

    # --- the plan -------------------------------------------------------------------------------

    def plan(self, depth: int) -> PlannedStep | None:
        works: list[SeqWork] = []
        seqs: list[Sequence] = []
        budget = self.max_step_tokens
        blocked = False
        for i, seq in enumerate(list(self.running)):
            if len(works) >= self.max_batch_size or budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING or seq.finalized or seq.preempting or seq.inflight_refs >= depth:
                continue  # (a victim preempted earlier in this loop is already back in `waiting`)
            work = self._next_work(seq, budget)
            if work is None:
                continue
            if not self._reserve(seq, work, victims=self.running[i:]):
                blocked = True
                continue
            works.append(work)
            seqs.append(seq)
            budget -= work.num_tokens
        while self.waiting and not blocked and len(works) < self.max_batch_size and budget > 0:
            seq = self.waiting[0]
            # admit only when the whole known prefix fits, so an admitted prompt can always progress
            if not self._free_rows or self.pool.num_free < self.pages_for(seq.num_known + 1):
                break
            self.waiting.popleft()
            seq.status, seq.row = SeqStatus.RUNNING, self._free_rows.pop()
            self.running.append(seq)
            work = self._next_work(seq, budget)
            if work is None or not self._reserve(seq, work, victims=[]):
                continue
            works.append(work)
            seqs.append(seq)
            budget -= work.num_tokens
        return PlannedStep(works, seqs) if works else None

    def _next_work(self, seq: Sequence, budget: int) -> SeqWork | None:
        output_index = len(seq.output_ids) + seq.pending_samples
        if seq.carry_on_device and seq.num_scheduled == seq.num_known + seq.pending_samples - 1:
            # decode: the input is the newest sampled token, read from the carry-over table on the
            # device whether or not its step has been committed (the same path at depth 1 and 2)
            if seq.samples_left() <= 0:
                return None
            return SeqWork(row=seq.row, tokens=None, start_pos=seq.num_scheduled, pages=seq.pages, sample=True,
                           output_index=output_index, sampling=seq.sampling)
        if seq.num_scheduled < seq.num_known:  # host-known tokens: a prompt (or recompute) chunk
            n = min(seq.num_known - seq.num_scheduled, budget)
            reaches_end = seq.num_scheduled + n == seq.num_known
            if reaches_end and seq.samples_left() <= 0:
                return None
            tokens = seq.known_tokens(seq.num_scheduled, seq.num_scheduled + n)
            return SeqWork(row=seq.row, tokens=tokens, start_pos=seq.num_scheduled, pages=seq.pages,
                           sample=reaches_end, output_index=output_index, sampling=seq.sampling)
        return None

    def _reserve(self, seq: Sequence, work: SeqWork, victims: list[Sequence]) -> bool:
        need = self.pages_for(work.start_pos + work.num_tokens) - len(seq.pages)
        while need > self.pool.num_free:
            victim = next((v for v in reversed(victims) if not v.finalized and not v.preempting), None)
            if victim is None:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.pages.extend(self.pool.allocate(need))
        work.pages = list(seq.pages)  # a snapshot: the step must not see later growth or release
        return True

    # --- release ------------------------------------------------------------------------------

    def preempt(self, seq: Sequence) -> None:
        seq.preempting = True
        self.num_preemptions += 1
        seq.num_preemptions += 1
        if seq.inflight_refs == 0:
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Return a sequence's pages and row. Only legal with no step in flight referencing it."""
        assert seq.inflight_refs == 0, f"{seq.request_id}: released with {seq.inflight_refs} steps in flight"
        self.pool.free(seq.pages)
        seq.pages = []
        if seq.row is not None:
            self._free_rows.append(seq.row)
            seq.row = None
        seq.carry_on_device = False
        if seq in self.running:
            self.running.remove(seq)
        if seq.finalized:
            seq.status = SeqStatus.FINISHED
        elif seq.preempting:  # recompute later from its known tokens, ahead of new arrivals
            seq.preempting = False
            seq.num_scheduled = 0
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    def drop_waiting(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

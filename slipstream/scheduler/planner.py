"""Plan: choose the next step's batch (continue, admit, chunk prefill, preempt).

Pure Python; sees only sequences and page counts. Rules:
  * A sequence is planned only while not finalized, not being preempted, and with fewer than
    `depth` steps in flight (so inflight_refs never exceeds the pipeline depth).
  * Decode rows first (one token each, read on the device from the row tables: nothing is built
    for them, the runner's persistent batch holds their state); then the rest of
    the step's token budget is shared among prompt chunks — running prompts and newly admitted
    ones — by water-filling: a short prompt gets all it needs, long prompts split what is left.
    So a long prompt never holds the whole budget while a short request waits behind it.
  * Admission reserves pages for the whole known prefix (+1 for the first sampled token), so an
    admitted prompt always runs to its first token and a newer admission cannot starve it.
  * No sample is scheduled beyond max_tokens (counting samples still in flight), so a length cap
    never creates a zombie; only EOS/stop/abort do.
  * A decode row that needs a page it cannot get makes the most recently admitted unplanned
    sequence (possibly itself) a preemption victim; its pages return when its inflight_refs reaches
    0 and it is recomputed from its known tokens. Pages that in-flight victims and zombies will
    return at their commits count as coming: if they cover the need, the row skips this step
    instead of preempting more (at depth 2 a victim frees nothing until its step commits).
  * `waiting` is a deque with lazy deletion: a request finished while waiting is only marked, so
    cancelling n waiting requests costs O(n), not O(n^2).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from slipstream.intmath import ceil_div
from slipstream.runtime.batch import SeqWork
from slipstream.scheduler.page_pool import PagePool
from slipstream.scheduler.sequence import Sequence, SeqStatus


def fair_shares(needs: list[int], budget: int) -> list[int]:
    """Split `budget` over `needs` by water-filling: the highest level L with sum(min(need, L)) <=
    budget, so small needs are met in full and large ones split the rest evenly; the rounding
    remainder (fewer tokens than unmet needs) goes one each to the earliest."""
    lo, hi = 0, max(needs, default=0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in needs) <= budget:
            lo = mid
        else:
            hi = mid - 1
    shares = [min(n, lo) for n in needs]
    left = budget - sum(shares)
    for i, need in enumerate(needs):
        if left <= 0:
            break
        if shares[i] < need:
            shares[i] += 1
            left -= 1
    return shares


@dataclass
class PlannedStep:
    """One step's batch: decode sequences (one device-fed token each, all sampled) first, then chunks
    of host-known tokens; `page_writes` are the page-table entries handed out since the last step."""

    decode: list[Sequence]
    chunks: list[SeqWork]
    chunk_seqs: list[Sequence]
    page_writes: list[int]  # flat (row, index, page) triples


class Planner:
    def __init__(self, pool: PagePool, page_size: int, max_batch_size: int, max_step_tokens: int):
        self.pool, self.page_size = pool, page_size
        self.max_batch_size, self.max_step_tokens = max_batch_size, max_step_tokens
        self.waiting: deque[Sequence] = deque()  # may hold finished entries (lazy deletion)
        self.num_waiting = 0  # entries of `waiting` still WAITING
        self.running: list[Sequence] = []  # admitted (holding a row), in admission order
        self._free_rows = list(range(max_batch_size, 0, -1))  # row 0 is never used
        self._page_writes: list[int] = []  # (row, index, page) handed out, not yet in a step
        self.num_preemptions = 0

    def pages_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.page_size)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.num_waiting += 1

    def has_work(self) -> bool:
        return self.num_waiting > 0 or any(not s.finalized for s in self.running)

    def _first_waiting(self) -> Sequence | None:
        while self.waiting and self.waiting[0].status is not SeqStatus.WAITING:
            self.waiting.popleft()  # finished while waiting
        return self.waiting[0] if self.waiting else None

    # --- the plan -------------------------------------------------------------------------------

    def plan(self, depth: int) -> PlannedStep | None:
        """The hot loop touches each running sequence once with a few attribute reads; a decode row
        builds nothing (its inputs live in the runner's row tables) unless it needs a new page."""
        decode: list[Sequence] = []
        prompts: list[Sequence] = []  # sequences with host-known tokens to prefill (or recompute)
        budget, max_rows, page_size = self.max_step_tokens, self.max_batch_size, self.page_size
        blocked = False
        running = list(self.running)  # (preemption removes victims from self.running)
        for i, seq in enumerate(running):
            if seq.finalized or seq.preempting or seq.inflight_refs >= depth or seq.row is None:
                continue  # (a victim preempted earlier in this loop is already back in `waiting`)
            pending = seq.pending_samples
            known = len(seq.prompt_ids) + len(seq.output_ids)
            if not seq.carry_on_device or seq.num_scheduled != known + pending - 1:
                if seq.num_scheduled < known:
                    prompts.append(seq)
                continue
            if len(decode) >= max_rows or budget <= 0 or seq.max_tokens - len(seq.output_ids) - pending <= 0:
                continue
            if seq.num_scheduled >= len(seq.pages) * page_size and not self._reserve(seq, seq.num_scheduled + 1,
                                                                                    running[i:]):
                blocked = True
                continue
            decode.append(seq)
            budget -= 1
        room = min(max_rows - len(decode), budget)  # prompt chunks that can still join
        prompts = prompts[:max(room, 0)]  # (a decode row's victims are admitted after it: none of these)
        while not blocked and len(prompts) < room and self._admit():
            prompts.append(self.running[-1])
        shares = fair_shares([p.num_known - p.num_scheduled for p in prompts], budget)
        chunks, chunk_seqs = [], []
        for seq, share in zip(prompts, shares):
            work = self._chunk_work(seq, share) if share > 0 else None
            if work is None or not self._reserve(seq, work.end_pos, victims=[]):
                continue
            chunks.append(work)
            chunk_seqs.append(seq)
        if not decode and not chunks:
            return None
        writes, self._page_writes = self._page_writes, []
        return PlannedStep(decode, chunks, chunk_seqs, writes)

    def _admit(self) -> bool:
        """Admit the first waiting sequence if a row and pages for its whole known prefix are free."""
        seq = self._first_waiting()
        if seq is None or not self._free_rows:
            return False
        need = self.pages_for(seq.num_known + 1)
        if self.pool.num_free < need:
            return False
        self.waiting.popleft()
        self.num_waiting -= 1
        seq.status, seq.row = SeqStatus.RUNNING, self._free_rows.pop()
        seq.pages = []
        self._give_pages(seq, need)
        self.running.append(seq)
        return True

    @staticmethod
    def _chunk_work(seq: Sequence, budget: int) -> SeqWork | None:
        """The next chunk of host-known tokens (a prompt, or a recompute after preemption)."""
        n = min(seq.num_known - seq.num_scheduled, budget)
        reaches_end = seq.num_scheduled + n == seq.num_known
        if reaches_end and seq.samples_left() <= 0:
            return None
        tokens = seq.known_tokens(seq.num_scheduled, seq.num_scheduled + n)
        history = ((seq.prompt_ids, list(seq.output_ids))
                   if seq.num_scheduled == 0 and seq.sampling.needs_history else None)
        return SeqWork(row=seq.row, tokens=tokens, start_pos=seq.num_scheduled, sample=reaches_end,
                       output_index=len(seq.output_ids) + seq.pending_samples, sampling=seq.sampling,
                       history=history)

    def _reserve(self, seq: Sequence, end_pos: int, victims: list[Sequence]) -> bool:
        """Pages for positions up to `end_pos`, preempting the newest of `victims` if none are free."""
        need = self.pages_for(end_pos) - len(seq.pages)
        while need > self.pool.num_free:
            if need <= self.pool.num_free + self.pages_pending_release():
                return False  # in-flight victims and zombies will return enough: skip this step
            victim = next((v for v in reversed(victims)
                           if not v.finalized and not v.preempting and v.row is not None), None)
            if victim is None:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            self._give_pages(seq, need)
        return True

    def _give_pages(self, seq: Sequence, n: int) -> None:
        """Append n pages to the sequence's page row; the runner's table learns them with the next step."""
        base = len(seq.pages)
        new = self.pool.allocate(n)
        seq.pages.extend(new)
        writes = self._page_writes
        for j, page in enumerate(new):
            writes += (seq.row, base + j, page)

    def pages_pending_release(self) -> int:
        """Pages that finished or preempted sequences still in flight return at their commits."""
        return sum(len(s.pages) for s in self.running if (s.finalized or s.preempting) and s.inflight_refs > 0)

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
            self.num_waiting += 1

    def drop_waiting(self, seq: Sequence) -> None:
        """A waiting sequence finished (aborted): marked only; `_first_waiting` skips it. O(1)."""
        seq.status = SeqStatus.FINISHED
        self.num_waiting -= 1

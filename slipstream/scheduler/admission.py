"""Admission: the waiting queue, the rows of the runner's persistent batch, and who holds them.

Rules, enforced here:
  * Admission reserves pages for the whole known prefix (+1 for the first sampled token), so an
    admitted prompt always runs to its first token and a newer admission cannot starve it.
  * `waiting` is a deque with lazy deletion: a request finished while waiting is only marked, so
    cancelling n waiting requests costs O(n), not O(n^2).
  * A preempted sequence waits again ahead of new arrivals (it is recomputed from its known tokens).
  * Prefix-cache hits are mapped here and only here, before the sequence's first step: a running
    sequence's page row is never remapped while a step of it is in flight. Hit pages count as
    shared (a reference each), so admission needs free pages only for the rest, and the sequence
    starts computing at the first token after them (the token budget counts only those). What the
    first admission maps is the request's `usage.cached_tokens`; a re-admission after a preemption
    hits the sequence's own pages and leaves it unchanged.
  * An admitted sequence holds a reference to each of its images' encoder-cache entries until it
    is released (EncoderCache.acquire here, release in Preemption.release).
"""
from __future__ import annotations

from collections import deque

from slipstream.scheduler.encoder_cache import EncoderCache
from slipstream.scheduler.page_reservation import PageReservation
from slipstream.scheduler.prefix_cache import PrefixCache
from slipstream.scheduler.sequence import Sequence, SeqStatus


class Admission:
    def __init__(self, max_batch_size: int, pages: PageReservation, cache: PrefixCache | None = None,
                 encoder_cache: EncoderCache | None = None):
        self.pages, self.cache, self.encoder_cache = pages, cache, encoder_cache
        self.waiting: deque[Sequence] = deque()  # may hold finished entries (lazy deletion)
        self.num_waiting = 0  # entries of `waiting` still WAITING
        self.running: list[Sequence] = []  # admitted (holding a row), in admission order
        self.free_rows = list(range(max_batch_size, 0, -1))  # row 0 is never used

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.num_waiting += 1

    def _first_waiting(self) -> Sequence | None:
        while self.waiting and self.waiting[0].status is not SeqStatus.WAITING:
            self.waiting.popleft()  # finished while waiting
        return self.waiting[0] if self.waiting else None

    def admit(self) -> Sequence | None:
        """Admit the first waiting sequence if a row and pages for its whole known prefix are free."""
        seq = self._first_waiting()
        if seq is None or not self.free_rows:
            return None
        cache = self.cache if seq.prefix.cache_extra is not None else None
        hit = cache.lookup(seq) if cache is not None else []
        need = self.pages.pages_for(seq.num_known + 1) - len(hit)
        pool = self.pages.pool
        if self.pages.num_free - sum(pool.refcount(p) == 0 for p in hit) < need:
            return None  # (evictable hit pages count as free until they are shared)
        self.waiting.popleft()
        self.num_waiting -= 1
        seq.status, seq.row = SeqStatus.RUNNING, self.free_rows.pop()
        seq.pages, seq.pages_released = [], 0
        self.pages.share(seq, hit)
        reused = len(hit) * self.pages.page_size
        seq.num_scheduled = seq.num_computed = seq.prefix.num_reused = reused
        if not seq.num_preemptions:  # (lookup leaves the last prompt token uncached)
            seq.prefix.num_cached_tokens = reused
        seq.prefix.num_registered_pages = len(hit)
        if cache is not None:
            cache.count(seq, len(hit))
        self.pages.give(seq, need)
        if seq.images is not None and self.encoder_cache is not None:
            self.encoder_cache.acquire(seq, reused)
        self.running.append(seq)
        return seq

    def drop_waiting(self, seq: Sequence) -> None:
        """A waiting sequence finished (aborted): marked only; `_first_waiting` skips it. O(1)."""
        seq.status = SeqStatus.RELEASED
        self.num_waiting -= 1

    def dismiss(self, seq: Sequence) -> None:
        """Take back its row (its pages are returned apart): it no longer runs."""
        if seq.row is not None:
            self.free_rows.append(seq.row)
            seq.row = None
        if seq in self.running:
            self.running.remove(seq)

    def requeue(self, seq: Sequence) -> None:
        """A dismissed preemption victim waits again, ahead of new arrivals."""
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_waiting += 1

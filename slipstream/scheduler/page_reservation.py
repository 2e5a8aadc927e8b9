"""Page reservation: hands pool pages to admitted sequences and records the page-table entries
(row, index, page) the next step carries to the runner. Knows nothing of which sequence should get
pages; admission and the Planner decide that, preemption makes room.

Rule, enforced here: the entries a step carries name each (row, index) at most once. The runner
applies them as one scatter, and with repeated indices the value that lands is undefined on CUDA.
Only a row's holder has entries for it, and a released holder's entries not yet in a step go with
its pages (`free`), including those a failed step gave back (`requeue`).

Rule, sliding window (`release_before`): a sequence's pages wholly before every layer's window of the
lowest position any step of it will still compute are given back while it runs. Only its own
reference is dropped (a page the prefix cache registered stays hittable, a page another sequence
shares stays that one's); no entry is written for it: the row's table keeps naming the page, whose
keys every kernel masks (they are outside the window), and whatever K/V a new holder writes there
are finite numbers times a zero weight."""
from __future__ import annotations

from slipstream.intmath import ceil_div
from slipstream.scheduler.page_pool import PagePool
from slipstream.scheduler.sequence import Sequence


class PageReservation:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self._writes: list[int] = []  # (row, index, page) handed out, not yet in a step

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def pages_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.page_size)

    def give(self, seq: Sequence, n: int) -> None:
        """Append n pages to the sequence's page row; the runner's table learns them with the next step."""
        row, base = seq.row, len(seq.pages)
        assert row is not None, f"{seq.request_id}: pages for a sequence without a row"
        new = self.pool.allocate(n)
        seq.pages.extend(new)
        writes = self._writes
        for j, page in enumerate(new):
            writes += (row, base + j, page)

    def release_before(self, seq: Sequence, pos: int) -> int:
        """Give back its pages wholly before position `pos` (still held ones); returns how many."""
        end = min(pos // self.page_size, len(seq.pages))
        start = seq.pages_released
        if end <= start:
            return 0
        self.pool.free(seq.pages[start:end][::-1])  # (the newest first, as `free` orders the LRU)
        seq.pages[start:end] = [0] * (end - start)
        seq.pages_released = end
        return end - start

    def share(self, seq: Sequence, pages: list[int]) -> None:
        """Map prefix-cache pages at the start of its (empty) page row, a reference each."""
        assert seq.row is not None and not seq.pages, f"{seq.request_id}: cache pages mapped onto a used row"
        for j, page in enumerate(pages):
            self.pool.share(page)
            self._writes += (seq.row, j, page)
        seq.pages.extend(pages)

    def take_writes(self) -> list[int]:
        """The entries handed out since the last step, for the step being planned."""
        writes, self._writes = self._writes, []
        return writes

    def requeue(self, writes: list[int], running: list[Sequence]) -> None:
        """Entries of failed steps (flat triples, launch order): a failed forward never applied them,
        and a sequence admitted in such a step without a chunk in it is not failed with it, so the
        next step carries again every entry a live sequence still holds (before newer ones); the
        rest belong to failed sequences, whose rows and pages are being given back. (Two failed steps
        may both hold one place's entry for the same page: kept once.)"""
        holders = {seq.row: seq for seq in running if not seq.finished and seq.row is not None}
        kept: list[int] = []
        seen: set[tuple[int, int]] = set()
        for i in range(0, len(writes), 3):
            row, index, page = writes[i], writes[i + 1], writes[i + 2]
            seq = holders.get(row)
            if seq is not None and index < len(seq.pages) and seq.pages[index] == page and (row, index) not in seen:
                seen.add((row, index))
                kept += (row, index, page)
        self._writes = kept + self._writes

    def free(self, seq: Sequence) -> None:
        """Give back its pages (it is being released, its row too). Its entries not yet in a step go
        with them: the row's next holder maps other pages at the same indices, and one step carrying
        both is a scatter with repeated indices (undefined on CUDA: the stale page may win)."""
        self.pool.free(seq.pages[seq.pages_released:][::-1])  # last pages first: the LRU evicts a prefix's tail
        seq.pages, seq.pages_released = [], 0  # before its head
        writes, row = self._writes, seq.row
        if writes and row in writes[::3]:
            self._writes = [x for i in range(0, len(writes), 3) if writes[i] != row for x in writes[i:i + 3]]

"""Page reservation: hands pool pages to admitted sequences and records the page-table entries
(row, index, page) the next step carries to the runner. Knows nothing of which sequence should get
pages; admission and the Planner decide that, preemption makes room."""
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

    def free(self, seq: Sequence) -> None:
        self.pool.free(seq.pages[::-1])  # last pages first: the LRU evicts a prefix's tail before its head
        seq.pages = []

"""Fixed pool of KV pages. Page 0 is the scratch page (padding writes) and is never handed out."""
from __future__ import annotations

from slipstream.errors import PipelineInvariantError


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (one is the scratch page)")
        self.total = num_pages - 1
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PipelineInvariantError(f"allocate({n}) with {len(self._free)} free pages; check can_allocate first")
        pages = [self._free.pop() for _ in range(n)]
        self._owned.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._owned:  # a double free would hand one page to two sequences
                raise PipelineInvariantError(f"page {p} freed twice or never allocated")
            self._owned.remove(p)
            self._free.append(p)

"""Fixed pool of KV pages, refcounted. Page 0 is the scratch page (padding writes) and is never handed out.

Rules, enforced here:
  * A page is held while its refcount is > 0 (one reference per sequence whose page row maps it);
    `free` drops one reference, never below 0 (a double free would hand one page to two sequences).
  * A page whose refcount reaches 0 returns to the never-cached free list, unless the prefix cache
    registered it: then it stays hittable in an LRU (`evictable`) until the pool needs a page and
    no never-cached one is left; the eviction unregisters it (`on_evict`) before it is handed out.
  * Free pages = never-cached free pages + evictable cached ones. Only `allocate` hands pages out,
    and only pages with refcount 0, so a page some sequence maps is never handed to another.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from slipstream.errors import PipelineInvariantError


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("the KV pool needs at least 2 pages (one is the scratch page)")
        self.total = num_pages - 1
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._refs: dict[int, int] = {}  # held page -> refcount (> 0)
        self.registered: set[int] = set()  # pages the prefix cache maps a hash to (held or evictable)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # registered, refcount 0, oldest first
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache forgets the page's hash

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self.evictable)

    def refcount(self, page: int) -> int:
        return self._refs.get(page, 0)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise PipelineInvariantError(f"allocate({n}) with {self.num_free} free pages; check can_allocate first")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:  # the least recently used cached page with no reference
                page, _ = self.evictable.popitem(last=False)
                self.registered.discard(page)
                if self.on_evict is not None:
                    self.on_evict(page)
            self._refs[page] = 1
            pages.append(page)
        return pages

    def share(self, page: int) -> None:
        """One more reference to a registered page (a prefix-cache hit); it stops being evictable."""
        if page not in self.registered:
            raise PipelineInvariantError(f"page {page} shared but not registered in the prefix cache")
        self._refs[page] = self._refs.get(page, 0) + 1
        self.evictable.pop(page, None)

    def register(self, page: int) -> None:
        """The prefix cache maps a hash to this held page (its K/V is complete and committed)."""
        if page not in self._refs:
            raise PipelineInvariantError(f"page {page} registered while not held")
        self.registered.add(page)

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page."""
        refs = self._refs
        for p in pages:
            n = refs.get(p, 0)
            if n <= 0:  # a double free would hand one page to two sequences
                raise PipelineInvariantError(f"page {p} freed twice or never allocated")
            if n > 1:
                refs[p] = n - 1
                continue
            del refs[p]
            if p in self.registered:
                self.evictable[p] = None  # newest at the end: evicted last
            else:
                self._free.append(p)

    def num_held(self) -> int:
        return len(self._refs)

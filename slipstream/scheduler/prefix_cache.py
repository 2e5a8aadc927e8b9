"""Prefix cache: block hash -> KV page, for pages whose K/V a committed step completed.

Rules, enforced here:
  * `register` is called only by the commit's bookkeeping (Pipeline.on_commit), for pages every
    token of which had its K/V written by a committed step (`Sequence.num_computed`), never for a
    zombie. A page in the cache is therefore never written again: a hit maps it read-only, below
    the positions its new sequence computes.
  * `lookup` reuses at most (num_known - 1) // page_size full pages: the last known token is always
    recomputed (its logits give the next token), so no hit ever covers a sequence's whole prefix.
  * One hash maps to one page: a second sequence that computed the same prefix meanwhile keeps its
    own copy unregistered (it is freed like any uncached page).
  * The pool evicts only pages with refcount 0 (PagePool); eviction forgets the hash here.
  * A page holding an image's placeholder tokens is keyed by the image's digest too
    (`block_hash.page_extra`): its K/V depends on the image, not on the placeholder ids. A page
    inside a bidirectional prefix is keyed by the whole prefix (`block_hash.prefix_extra`): its
    K/V depends on the later positions of the prefix too (Moondream's BOS sees the image).
"""
from __future__ import annotations

from dataclasses import dataclass

from slipstream.scheduler.block_hash import ROOT, chain_hash, page_extra, prefix_extra
from slipstream.scheduler.page_pool import PagePool
from slipstream.scheduler.sequence import Sequence


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up (known tokens at each admission that may use the cache)
    hits: int = 0  # of those, tokens whose K/V came from the cache
    cached_pages: int = 0  # pages registered now (in use or evictable)
    evictions: int = 0  # registered pages handed out again for new K/V


def _carry_key(seq: Sequence, start: int, end: int) -> bytes:
    inputs = seq.carried_inputs(start, end)
    return repr(inputs).encode() if inputs else b""


class PrefixCache:
    def __init__(self, pool: PagePool, page_size: int):
        self.pool, self.page_size = pool, page_size
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.queries = self.hits = self.evictions = 0
        pool.on_evict = self._evicted

    def _evicted(self, page: int) -> None:
        del self._page_of[self._hash_of.pop(page)]
        self.evictions += 1

    def hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """The chain hashes of its first `num_pages` full pages of known tokens, extended on demand
        (tokens only ever append, so they stay valid across preemptions)."""
        hashes, ps = seq.prefix.block_hashes, self.page_size
        if len(hashes) < num_pages:
            extra = seq.prefix.cache_extra or b""
            images = [(s.start, s.end, s.digest) for s in seq.images.spans] if seq.images is not None else []
            bidi = seq.bidirectional_len
            prefix = prefix_extra(extra, seq.prompt_ids[:bidi], images) if bidi and len(hashes) * ps < bidi else b""
            prev = hashes[-1] if hashes else ROOT
            for i in range(len(hashes), num_pages):
                key = page_extra(extra, images, i * ps, (i + 1) * ps) if images else extra
                if i * ps < bidi:
                    key = prefix + key
                # a page whose inputs include carried values hashes them too: same tokens, other values,
                # other K/V
                if seq.carried:
                    key = key + _carry_key(seq, i * ps, (i + 1) * ps)
                prev = chain_hash(prev, seq.known_tokens(i * ps, (i + 1) * ps), key)
                hashes.append(prev)
        return hashes[:num_pages]

    def lookup(self, seq: Sequence) -> list[int]:
        """Pages holding its longest cached prefix, at most (num_known - 1) // page_size of them."""
        pages = []
        for h in self.hashes(seq, (seq.num_known - 1) // self.page_size):
            page = self._page_of.get(h)
            if page is None:  # a chain hash covers every earlier page: the first miss ends the prefix
                break
            pages.append(page)
        return pages

    def count(self, seq: Sequence, hit_pages: int) -> None:
        self.queries += seq.num_known
        self.hits += hit_pages * self.page_size

    def register(self, seq: Sequence) -> None:
        """Its full pages of committed K/V not yet in the cache (the commit's bookkeeping calls this)."""
        full = seq.num_computed // self.page_size
        hashes = self.hashes(seq, full)
        for i in range(seq.prefix.num_registered_pages, full):
            page, h = seq.pages[i], hashes[i]
            if i >= seq.pages_released and h not in self._page_of and page not in self._hash_of:
                self._page_of[h], self._hash_of[page] = page, h
                self.pool.register(page)
        seq.prefix.num_registered_pages = full

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries, self.hits, len(self._hash_of), self.evictions)

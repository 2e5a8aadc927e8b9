"""Encoder cache: which images' encoder outputs the runner holds, by digest (the host's bookkeeping;
the runner keeps the tensors, `Runner.launch_encoder` / `Runner.drop_features`).

Rules, enforced here:
  * An admitted sequence holds a reference to each of its images (`acquire` at admission, `release`
    when its pages and row are released: finished, aborted or preempted, always with no step of it
    in flight), except an image whose pages all came from the prefix cache: no chunk feeds it. A
    preempted sequence gives its references back and takes them again when it is re-admitted (for
    the images its new hit does not cover): its images stay hittable meanwhile, like its pages.
  * An entry with references is never evicted, so no launched step ever reads a dropped output
    (a step's sequences hold their references until it commits).
  * Entries without references stay hittable in LRU order while the cache holds at most
    `max_features` output rows; the least recently used are evicted beyond that. Entries in use may
    exceed the bound (they cannot be dropped); eviction catches up as they are released.
  * An image's encoder runs once per entry: `needs_encode` is true until a step that feeds its rows
    is planned with the encode (`launched`). A step that failed forgets its launches (`unlaunch`):
    the next step that needs the rows encodes again.
  * Entries are keyed by `ImageSpan.digest`, which holds the request's cache salt
    (`block_hash.image_key`): requests with different salts never share one.
Counters: a hit is an image of an admitted sequence whose entry existed (encoded or about to be);
a miss creates the entry, so misses == encoder runs (failures apart).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from slipstream.scheduler.sequence import Sequence


@dataclass
class _Entry:
    num_features: int
    refs: int = 0
    encoded: bool = False  # its encode was launched (stream order runs it before any reader)


@dataclass
class EncoderCacheStats:
    hits: int = 0
    misses: int = 0
    entries: int = 0
    features: int = 0  # encoder output rows held (in use or evictable)
    evictions: int = 0


class EncoderCache:
    def __init__(self, max_features: int):
        if max_features < 0:
            raise ValueError(f"max_features must be >= 0, got {max_features}")
        self.max_features = max_features
        self._entries: dict[bytes, _Entry] = {}
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # entries without references, oldest first
        self.features = 0
        self.hits = self.misses = self.evictions = 0
        self.dropped: list[bytes] = []  # evicted, not yet dropped by the runner (`take_dropped`)

    def acquire(self, seq: Sequence, start: int = 0) -> None:
        """A reference to each of its images that a chunk will feed (admission; its first chunk starts
        at `start`, where its prefix-cache hit ends): an image whose pages all came from the prefix
        cache is never encoded nor read, so it is neither counted nor kept."""
        images = seq.images
        assert images is not None and not images.held, f"{seq.request_id}: no images, or acquired twice"
        held = tuple(span for span in images.spans if span.end > start)
        for span in held:
            entry = self._entries.get(span.digest)
            if entry is None:
                entry = self._entries[span.digest] = _Entry(span.num_features)
                self.features += span.num_features
                self.misses += 1
            else:
                self.hits += 1
                self._lru.pop(span.digest, None)
            entry.refs += 1
        images.held = tuple(span.digest for span in held)
        self._evict()

    def release(self, seq: Sequence) -> None:
        """Drop its references (its pages and row are being released: nothing of it is in flight)."""
        images = seq.images
        if images is None:
            return
        held, images.held = images.held, ()
        for digest in held:
            entry = self._entries[digest]
            entry.refs -= 1
            assert entry.refs >= 0, f"{seq.request_id}: encoder-cache reference dropped twice"
            if entry.refs == 0:
                self._lru[digest] = None
        self._evict()

    def needs_encode(self, digest: bytes) -> bool:
        return not self._entries[digest].encoded

    def launched(self, digest: bytes) -> None:
        self._entries[digest].encoded = True

    def unlaunch(self, digest: bytes) -> None:
        """Its encode ran in a failed step: it may not have run (a failed stream skips work)."""
        entry = self._entries.get(digest)
        if entry is not None:
            entry.encoded = False

    def in_use(self, digest: bytes) -> bool:
        entry = self._entries.get(digest)
        return entry is not None and entry.refs > 0

    def take_dropped(self) -> list[bytes]:
        """Digests evicted since the last call, for `Runner.drop_features`."""
        dropped, self.dropped = self.dropped, []
        return dropped

    def _evict(self) -> None:
        while self.features > self.max_features and self._lru:
            digest, _ = self._lru.popitem(last=False)
            self.features -= self._entries.pop(digest).num_features
            self.evictions += 1
            self.dropped.append(digest)

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(self.hits, self.misses, len(self._entries), self.features, self.evictions)

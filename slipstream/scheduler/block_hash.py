"""Block hashes: the one key of a full KV page's content, shared by the prefix cache and the Ray router.

Page i's hash chains (page i-1's hash, page i's token ids, extra keys), so equal hashes mean equal
whole prefixes: a page's K/V depends on every earlier token (causal attention), never on later ones.
`extra` isolates what the token ids do not say: the request's LoRA adapter (`lora_key`: no page is
shared across adapters), its cache salt (tenants never share a page) and the digests of the images whose placeholder tokens the page holds (`page_extra`: two
prompts with the same text and other images never share a page). A partial last page has no hash:
a page still being filled is not shared.

A bidirectional prefix (Moondream's BOS + image) breaks "never on later ones": each of its positions
attends to the whole prefix, so every page that overlaps it also carries the whole prefix's key
(`prefix_extra`: its token ids and images), even a page holding BOS alone (page_size 1).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

ROOT = b"slipstream-prefix-v1"


def chain_hash(parent: bytes, page_ids: Sequence[int], extra: bytes = b"") -> bytes:
    # page_ids has a fixed byte length (page_size int64s), so appending `extra` is unambiguous
    return hashlib.blake2b(parent + array("q", page_ids).tobytes() + extra, digest_size=16).digest()


def block_hashes(ids: Sequence[int], page_size: int, extra: bytes = b"",
                 images: Sequence[tuple[int, int, bytes]] = (), bidirectional_len: int = 0) -> list[bytes]:
    """Chained 16-byte hashes of the full `page_size`-token blocks of `ids`; `images`: (start, end,
    digest) of each image's placeholder positions (none: the extra key is `extra` on every page);
    `bidirectional_len`: the leading positions that attend both ways (0: none)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    prefix = prefix_extra(extra, ids[:bidirectional_len], images) if bidirectional_len else b""
    out, prev = [], ROOT
    for start in range(0, len(ids) - page_size + 1, page_size):
        key = page_extra(extra, images, start, start + page_size)
        prev = chain_hash(prev, ids[start:start + page_size], prefix + key if start < bidirectional_len else key)
        out.append(prev)
    return out


def prefix_extra(extra: bytes, prefix_ids: Sequence[int], images: Sequence[tuple[int, int, bytes]]) -> bytes:
    """The key every page overlapping a bidirectional prefix carries before its own extra key: a tag,
    then a fixed-length hash of the salt, the prefix's token ids and the images inside it (so the
    concatenation stays unambiguous: no other extra key starts with the tag)."""
    n = len(prefix_ids)
    h = hashlib.blake2b(array("q", prefix_ids).tobytes(), digest_size=16)
    h.update(hashlib.blake2b(extra, digest_size=16).digest())
    for start, end, d in images:
        if start < n:
            h.update(array("q", (start, end, len(d))).tobytes() + d)
    return b"bidirectional:" + h.digest()


def page_extra(extra: bytes, images: Sequence[tuple[int, int, bytes]], lo: int, hi: int) -> bytes:
    """The extra key of the page holding positions [lo, hi): `extra` alone when no image overlaps it
    (so text pages keep their hashes, the router's included), else a key that cannot equal any
    image-free one: a tag, the salt's hash (fixed length), then each overlapping image's digest,
    length-prefixed."""
    digests = [d for start, end, d in images if start < hi and lo < end]
    if not digests:
        return extra
    parts = [b"images:", hashlib.blake2b(extra, digest_size=16).digest()]
    for d in digests:
        parts += [len(d).to_bytes(2, "little"), d]
    return b"".join(parts)


def salt_key(cache_salt: str | None) -> bytes:
    """The `extra` bytes of a request's cache salt (none: b"", the router's unsalted hashes)."""
    return b"" if cache_salt is None else b"salt:" + cache_salt.encode("utf-8")


def image_key(digest: bytes, cache_salt: str | None) -> bytes:
    """An image's key (ImageSpan.digest: its encoder-cache entry, the runner's output, its pages'
    extra key) from its pixels' digest and the request's cache salt: tenants with different salts
    never share an encoder output either, so none can time whether another sent the same picture.
    Unsalted requests keep the digest itself."""
    if cache_salt is None:
        return digest
    return hashlib.blake2b(salt_key(cache_salt) + digest, digest_size=32).digest()


def lora_key(adapter: str | None) -> bytes:
    """The `extra` bytes of a request's LoRA adapter (api/lora.py's key, unique per load; none: b"",
    so base-model hashes are unchanged). A tag and a fixed-length hash, placed before the salt's key:
    no salt key starts with the tag, so the concatenation stays unambiguous."""
    return b"" if adapter is None else b"lora:" + hashlib.blake2b(adapter.encode("utf-8"), digest_size=16).digest()

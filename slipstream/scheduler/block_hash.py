"""Block hashes: the one key of a full KV page's content, shared by the prefix cache and the Ray router.

Page i's hash chains (page i-1's hash, page i's token ids, extra keys), so equal hashes mean equal
whole prefixes: a page's K/V depends on every earlier token (causal attention), never on later ones.
`extra` isolates what the token ids do not say: the request's cache salt (tenants never share a
page), later an image hash. A partial last page has no hash: a page still being filled is not shared.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

ROOT = b"slipstream-prefix-v1"


def chain_hash(parent: bytes, page_ids: Sequence[int], extra: bytes = b"") -> bytes:
    # page_ids has a fixed byte length (page_size int64s), so appending `extra` is unambiguous
    return hashlib.blake2b(parent + array("q", page_ids).tobytes() + extra, digest_size=16).digest()


def block_hashes(ids: Sequence[int], page_size: int, extra: bytes = b"") -> list[bytes]:
    """Chained 16-byte hashes of the full `page_size`-token blocks of `ids`."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive, got {page_size}")
    out, prev = [], ROOT
    for start in range(0, len(ids) - page_size + 1, page_size):
        prev = chain_hash(prev, ids[start:start + page_size], extra)
        out.append(prev)
    return out


def salt_key(cache_salt: str | None) -> bytes:
    """The `extra` bytes of a request's cache salt (none: b"", the router's unsalted hashes)."""
    return b"" if cache_salt is None else b"salt:" + cache_salt.encode("utf-8")

"""Prefix-aware replica choice, free of Ray: block-hash chains, a prefix → replica table, the policy.

A prompt's full page-sized token blocks are hashed as a chain (block i's hash covers blocks 0..i),
the same key a paged prefix cache uses for a page, so "replica R has served chain hash h" means
R has (or recently had) the KV pages of that whole prefix. The policy sends a request to the live
replica holding the longest prefix of its chain, unless the replicas' queues are unbalanced by
more than a threshold: then (and when nothing matches) it falls back to power-of-two-choices on
queue length. `slipstream.serve.ray_router` plugs this into Ray Serve's request-router interface.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence, TypeVar

from slipstream.scheduler.block_hash import block_hashes, image_key, salt_key

__all__ = ["block_hashes", "PrefixTable", "Choice", "choose"]

R = TypeVar("R", bound=Hashable)

_RNG = random.Random()


class PrefixTable:
    """Which replica last served each chain hash; least recently used entries fall out past `capacity`
    (bounded like the KV cache it approximates)."""

    def __init__(self, capacity: int = 1 << 18):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._owner: OrderedDict[bytes, Hashable] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def longest_match(self, hashes: Sequence[bytes], live: set) -> tuple[Hashable | None, int]:
        """The live replica holding the longest prefix of `hashes`, and how many blocks it holds."""
        best, depth = None, 0
        for i, h in enumerate(hashes):  # a chain hash implies all earlier blocks: stop at the first miss
            owner = self._owner.get(h)
            if owner is None or owner not in live:
                break
            best, depth = owner, i + 1
        return best, depth

    def record(self, hashes: Sequence[bytes], replica: Hashable) -> None:
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def owners(self) -> set:
        return set(self._owner.values())

    def forget(self, replica: Hashable) -> int:
        """Drop a dead replica's entries; how many were dropped."""
        gone = [h for h, r in self._owner.items() if r == replica]
        for h in gone:
            del self._owner[h]
        return len(gone)


@dataclass(frozen=True)
class Choice:
    ranks: list[list]  # most preferred first; Ray Serve tries rank by rank
    reason: str  # "prefix" | "balance" | "no_match"
    matched_blocks: int = 0


def choose(hashes: Sequence[bytes], candidates: Sequence[R], queue_len: Callable[[R], int | None],
           table: PrefixTable, key: Callable[[R], Hashable], imbalance_threshold: int,
           rng: random.Random | None = None) -> Choice:
    """Rank `candidates` for a request whose prompt has chain `hashes`.

    Queues unbalanced (longest - shortest known > threshold) → power of two choices; else the
    replica with the longest cached prefix first, the rest after it; no prefix match → power of
    two choices (the least loaded of two random replicas)."""
    rng = rng or _RNG
    if not candidates:
        return Choice([], "no_match")
    lens = [q for q in (queue_len(c) for c in candidates) if q is not None]
    if len(lens) >= 2 and max(lens) - min(lens) > imbalance_threshold:
        return Choice([_two_choices(candidates, queue_len, rng)], "balance")
    by_key = {key(c): c for c in candidates}
    owner, depth = table.longest_match(hashes, set(by_key))
    if owner is None:
        return Choice([_two_choices(candidates, queue_len, rng)], "no_match")
    rest = [c for k, c in by_key.items() if k != owner]
    return Choice([[by_key[owner]], rest] if rest else [[by_key[owner]]], "prefix", depth)


def _two_choices(candidates: Sequence[R], queue_len: Callable[[R], int | None], rng: random.Random) -> list[R]:
    pair = list(candidates) if len(candidates) <= 2 else rng.sample(list(candidates), 2)
    rng.shuffle(pair)  # unknown queue lengths: a random order, not always the first replica
    return sorted(pair, key=lambda c: (q if (q := queue_len(c)) is not None else 0))


def request_hashes(ids: Sequence[int], page_size: int, params: object = None,
                   images: Sequence[tuple[int, int, bytes]] = ()) -> list[bytes]:
    """The chain a replica's prefix cache keys this request's pages by: salted with its
    SamplingParams.cache_salt as the engine salts them (block_hash.salt_key). Requests with
    different salts never share a replica's pages, so their prefixes must not attract each other.
    `images`: (start, end, pixel digest) of each image in the expanded `ids`, keyed with the salt as
    the engine keys the pages holding them (block_hash.image_key, page_extra); without images the
    chain is the text's alone."""
    salt = getattr(params, "cache_salt", None)
    return block_hashes(ids, page_size, salt_key(salt), [(s, e, image_key(d, salt)) for s, e, d in images])

"""Buckets for captured graphs: which sizes exist and which one a step uses.

Decode graphs are bucketed by batch size (`make_buckets`), mixed/prefill graphs by token count
(`token_buckets`: powers of two from `min`, then `max`, e.g. (16, 512) -> 16, 32, ..., 512 and
(16, 600) -> 16, ..., 512, 600), so a step pads at most to twice its tokens.

Buckets come from (min, step, max): `min` doubles while below `step` (the ramp-up, where padding
a small batch to the next multiple of `step` would waste most of the step), then every multiple
of `step` up to `max`; `max` itself is always a bucket so every batch up to it fits.
  min=1, step=16, max=64  ->  1, 2, 4, 8, 16, 32, 48, 64
  min=16, step=16, max=64 ->  16, 32, 48, 64            (no ramp-up)
A batch is padded to the smallest bucket that holds it; above `max` there is no bucket and the
step runs eagerly. Pure Python: the scheduler-free runtime uses it, tests check it without a GPU.
"""
from __future__ import annotations

import bisect

from slipstream.errors import InvalidRequestError
from slipstream.intmath import round_up


def make_buckets(min_size: int, step: int, max_size: int) -> list[int]:
    if min_size < 1 or step < 1 or max_size < min_size:
        raise InvalidRequestError(
            f"graph buckets need 1 <= min <= max and step >= 1, got min={min_size} step={step} max={max_size}")
    buckets = []
    size = min_size
    while size < step and size < max_size:  # ramp-up
        buckets.append(size)
        size *= 2
    size = max(step, round_up(size, step))  # first multiple of step at or past the ramp
    while size < max_size:
        buckets.append(size)
        size += step
    buckets.append(max_size)
    return sorted(set(buckets))


def pick_bucket(buckets: list[int], n: int) -> int | None:
    """The smallest bucket holding `n` rows, or None when `n` is above the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def token_buckets(min_tokens: int, max_tokens: int) -> list[int]:
    if min_tokens < 1 or max_tokens < min_tokens:
        raise InvalidRequestError(
            f"token buckets need 1 <= min <= max, got min={min_tokens} max={max_tokens}", param="graph_token_sizes")
    buckets = []
    size = min_tokens
    while size < max_tokens:
        buckets.append(size)
        size *= 2
    buckets.append(max_tokens)
    return buckets

"""Packed token masks: one int32 word per 32 token ids, bit j of word i allows token 32*i + j.

A row covers the full logits width V (padding columns included) in `words_for(V)` words. Bits for
ids a tokenizer does not have stay 0, so padding columns can never be sampled. The layout is the one
llguidance writes, so its matchers fill a row in place.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


def words_for(vocab_size: int) -> int:
    """Words in one row for a logits width of `vocab_size` (ceil(V / 32))."""
    if vocab_size < 0:
        raise ValueError(f"vocab_size must be >= 0, got {vocab_size}")
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A zeroed (nothing allowed) int32 array of shape (rows, words_for(vocab_size))."""
    return np.zeros((rows, words_for(vocab_size)), dtype=np.int32)


def _words_u32(row: np.ndarray) -> np.ndarray:
    if row.dtype != np.int32:
        raise TypeError(f"a bitmask row must be int32, got {row.dtype}")
    return row.view(np.uint32)


def set_allowed(row: np.ndarray, ids: Iterable[int]) -> None:
    """Set the bits of `ids` in one int32 row (in place; other bits are kept)."""
    idx = np.fromiter(ids, dtype=np.int64)
    if idx.size == 0:
        return
    words = _words_u32(row)
    if idx.min() < 0 or idx.max() >= 32 * words.shape[-1]:
        raise IndexError(f"token id out of range for a row of {words.shape[-1]} words")
    np.bitwise_or.at(words, idx >> 5, (np.uint32(1) << (idx & 31).astype(np.uint32)))


def clear_from(row: np.ndarray, first_id: int) -> None:
    """Clear every bit for ids >= `first_id` (keeps padding columns disallowed)."""
    words = _words_u32(row)
    w, b = divmod(first_id, 32)
    if w >= words.shape[-1]:
        return
    if b:
        words[w] &= np.uint32((1 << b) - 1)
        w += 1
    words[w:] = 0


def allowed_ids(row: np.ndarray, vocab_size: int) -> list[int]:
    """The allowed token ids of one row below `vocab_size`, ascending (for tests and debugging)."""
    bits = np.unpackbits(np.ascontiguousarray(row, dtype="<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size]).tolist()


_SHIFTS: dict[Any, Any] = {}  # device -> arange(32) int32 on it


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack an int32 (n, W) bitmask into a bool (n, vocab_size) tensor on the same device."""
    import torch

    if bitmask.dtype != torch.int32:
        raise TypeError(f"bitmask must be int32, got {bitmask.dtype}")
    n, w = bitmask.shape
    if 32 * w < vocab_size:
        raise ValueError(f"a bitmask of {w} words covers {32 * w} ids, fewer than vocab_size={vocab_size}")
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = torch.bitwise_and(torch.bitwise_right_shift(bitmask.unsqueeze(-1), shifts), 1)
    return bits.view(n, 32 * w)[:, :vocab_size].bool()

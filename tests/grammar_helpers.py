"""Shared helpers for the grammar tests: the SmolLM2 tokenizer (loaded once) and matcher drivers."""
from __future__ import annotations

import functools

import numpy as np

from slipstream.grammar import allocate_bitmask, allowed_ids


@functools.lru_cache(maxsize=1)
def smollm_tokenizer():
    from slipstream.models.loading.gguf_loader import load_gguf_tokenizer
    from slipstream.models.loading.loader import resolve_model_path

    return load_gguf_tokenizer(resolve_model_path("smollm2-135m"))


def mask_of(matcher, vocab_size: int, fill: int = 0) -> np.ndarray:
    """The matcher's row, written into a row pre-filled with `fill` (it must overwrite all of it)."""
    row = allocate_bitmask(1, vocab_size)[0]
    row[:] = fill
    matcher.fill_bitmask(row)
    return row


def allowed(matcher, vocab_size: int) -> set[int]:
    return set(allowed_ids(mask_of(matcher, vocab_size), vocab_size))


def drive(matcher, ids, vocab_size: int) -> None:
    """Accept `ids` one by one, checking first that the mask allows each."""
    for k, t in enumerate(ids):
        row = mask_of(matcher, vocab_size)
        assert row.view(np.uint32)[t >> 5] >> (t & 31) & 1, f"token {t} (step {k}) not allowed by the mask"
        matcher.accept(t)

"""The drafter plugin point: what proposes a speculating row's drafts, on the device.

A drafter sees a row's tokens as the runner feeds and emits them (`on_chunks`, `on_emitted`, on the
compute stream, in stream order with the forwards) and proposes up to `max_drafts` tokens per row
right after a step's acceptance (`propose`), so the next step's forward reads them from the device
(docs/speculative.md). It never reads the host. Built-in: "ngram" (speculation/ngram_drafter.py);
others plug in by name (speculation/registry.py).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class Proposal(NamedTuple):
    tokens: torch.Tensor  # [n, max_drafts] int64 drafts, every entry a valid token id
    matched: torch.Tensor  # [n] bool: the drafter had something to go on (False: filler drafts)
    probs: torch.Tensor | None = None  # [n, max_drafts, V] what drafts were drawn from; None: point drafts
    # [n] int64 how much the drafter had to go on (n-gram: the matched length, 0: none); None: no
    # measure. Where the forward's shape may follow the device (the CPU), a speculating step feeds
    # fewer drafts for a weak proposal (speculation/runner.py)
    strength: torch.Tensor | None = None


class Drafter(Protocol):
    max_drafts: int

    def on_chunks(self, token_rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor,
                  chunk_rows: torch.Tensor, chunk_ends: torch.Tensor) -> None:
        """Host-known tokens [T] a step feeds (prompt chunks, a recompute), before its forward."""

    def on_emitted(self, rows: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """A step's emitted tokens [n, w] (each row's first counts[i]), after its acceptance."""

    def propose(self, rows: torch.Tensor) -> Proposal:
        """Drafts for the rows' next step, after on_emitted of this one."""

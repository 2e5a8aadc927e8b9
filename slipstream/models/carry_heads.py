"""The model side of the carry: heads that turn a hidden state into values and values into an input.

A model may expose `carry_heads` (a `CarryHeads`; None or absent: it has none). Carry kind k >= 1 is
`kinds[k - 1]`, a `CarryKind(name, values)`: `decode(k, hidden)` maps hidden states [n, H] to
float32 values [n, values] (Moondream: a coordinate from the coordinate head, a width and height
from the size head), `encode(k, values)` maps values [n, values] back to input embeddings [n, H].
Kind 0 is a plain token id. Both must be device tensor ops only: no `.item()`, no host read, fixed
shapes (the runtime runs them for every row of a step that has a carry row; docs/moondream.md,
"The carry").

The forward honours two fields of `ForwardBatch` (models/llama/model.py):
  * `carry` (a `CarryInput`): token rows whose kind is > 0 take `encode(kind, values)` instead of
    their token's embedding;
  * `return_hidden`: the forward returns `(logits, hidden)`, hidden [N, H] for the sample rows:
    what `decode` reads (the model decides which hidden state that is).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from slipstream.models.carry_kind import CarryKind

__all__ = ["CarryHeads", "CarryInput", "CarryKind", "apply_carry", "carry_width", "decode_carry"]


@runtime_checkable
class CarryHeads(Protocol):
    @property
    def kinds(self) -> Sequence[CarryKind]:
        """Kind k >= 1 is kinds[k - 1]."""
        ...

    def decode(self, kind: int, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [n, H] -> float32 values [n, kinds[kind - 1].values]."""
        ...

    def encode(self, kind: int, values: torch.Tensor) -> torch.Tensor:
        """Values [n, kinds[kind - 1].values] -> input embeddings [n, H]."""
        ...


@dataclass
class CarryInput:
    """Per token row of a step: its input kind (0: the token id) and values [T, width] (float32)."""

    kinds: torch.Tensor  # [T] int64
    values: torch.Tensor  # [T, width] float32 (columns past a kind's own count are ignored)


def carry_width(heads: CarryHeads | None) -> int:
    """The widest kind's value count (0: no heads)."""
    return max((k.values for k in heads.kinds), default=0) if heads is not None else 0


def apply_carry(heads: CarryHeads, x: torch.Tensor, carry: CarryInput) -> torch.Tensor:
    """`x` (token embeddings [T, H]) with each carry row's embedding replaced by its head encoding.
    Every kind is encoded for every row and chosen per row with torch.where: no host read."""
    pick = carry.kinds[:, None]
    for k, kind in enumerate(heads.kinds, start=1):
        enc = heads.encode(k, carry.values[:, :kind.values]).to(x.dtype)
        x = torch.where(pick == k, enc, x)
    return x


def decode_carry(heads: CarryHeads, kinds: torch.Tensor, hidden: torch.Tensor, width: int) -> torch.Tensor:
    """Values [n, width] float32: row i holds decode(kinds[i], hidden[i]) (zeros where kind 0)."""
    out = torch.zeros(hidden.shape[0], width, dtype=torch.float32, device=hidden.device)
    pick = kinds[:, None]
    for k, kind in enumerate(heads.kinds, start=1):
        dec = heads.decode(k, hidden).float().reshape(hidden.shape[0], kind.values)
        if kind.values < width:
            dec = torch.nn.functional.pad(dec, (0, width - kind.values))
        out = torch.where(pick == k, dec, out)
    return out

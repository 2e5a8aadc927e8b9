"""Moondream's region heads as the runtime's carry heads (models/carry_heads.py).

Kind 1 "coordinate" (one value) and kind 2 "size" (width, height). x and y are both coordinates:
the reference decodes x from the hidden state that chose the coordinate token, feeds
encode_coordinate(x), and decodes y from the next step's hidden state with the same head. The
hidden state is the last block's output before the final LayerNorm (`forward_hidden`).
"""
from __future__ import annotations

import torch

from slipstream.models.carry_kind import CarryKind
from slipstream.models.moondream.region import RegionHeads

COORDINATE, SIZE = CarryKind("coordinate", 1), CarryKind("size", 2)


class RegionCarryHeads:
    kinds = (COORDINATE, SIZE)

    def __init__(self, region: RegionHeads):
        self.region = region

    def decode(self, kind: int, hidden: torch.Tensor) -> torch.Tensor:
        if kind == 1:
            return self.region.decode_coordinate(hidden)[:, None]
        if kind == 2:
            return self.region.decode_size(hidden)
        raise ValueError(f"moondream has carry kinds 1 (coordinate) and 2 (size), not {kind}")

    def encode(self, kind: int, values: torch.Tensor) -> torch.Tensor:
        if kind == 1:
            return self.region.encode_coordinate(values[:, 0])
        if kind == 2:
            return self.region.encode_size(values)
        raise ValueError(f"moondream has carry kinds 1 (coordinate) and 2 (size), not {kind}")

"""Moondream 2's region heads: coordinates and sizes as input embeddings and out of hidden states.

Encoders: Fourier features cat(cos 2πxW, sin 2πxW) of the value (a coordinate: 1 number, a size:
width and height), then one Linear to the text width. Decoders: an MLP (fc1 -> GELU(tanh) -> fc2)
from the hidden state to bin logits: `coord_bins` for a coordinate, 2 x `size_bins` for (width,
height). The hidden state is the text model's last block output before its final LayerNorm.

Bins to values:
- size: 2^((bin / (size_bins - 1)) * 10 - 10), a log scale from 2^-10 to 1 (both sources agree).
- coordinate: bin / coord_bins (0 .. 1023/1024). The public reference (vikhyat/moondream, what
  moondream2's own `point`/`detect` run) divides by the bin count; kestrel's table spans
  linspace(0, 1, bins), i.e. bin / 1023. We follow the reference: slipstream's results then match
  what moondream2 itself returns, and the value fed back as the next input is the one the
  reference feeds (the two differ by at most 1/1024 of the image side).

Every function is tensor ops on the device (argmax, arithmetic, matmuls): no .item(), no host
sync, fixed shapes, so the runtime can run them per step for every row, inside a CUDA graph.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from slipstream.models.moondream.config import MoondreamRegionConfig
from slipstream.models.moondream.vision import GeluMLP


def fourier_features(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [N, k] @ freqs [k, F] -> [N, 2F] = cat(cos 2πxW, sin 2πxW)."""
    f = 2 * math.pi * (x @ freqs)
    return torch.cat([f.cos(), f.sin()], dim=-1)


def coordinate_from_bin(bins: torch.Tensor, num_bins: int) -> torch.Tensor:
    return bins.float() / num_bins


def size_from_bin(bins: torch.Tensor, num_bins: int) -> torch.Tensor:
    # float32 exp2 on the CPU rounds a value differently in a vector lane than in the scalar tail,
    # so a row's size would depend on where it sits in the batch (depth 2 then differs from depth 1).
    # In float64 every one of the 1024 bins' values lies > 70,000 double ulps from a float32 rounding
    # boundary: the cast gives the correctly rounded value on any path (tests/test_moondream_model.py).
    return torch.exp2(bins.double() / (num_bins - 1) * 10.0 - 10.0).float()


class RegionHeads(nn.Module):
    def __init__(self, config: MoondreamRegionConfig, hidden_size: int):
        super().__init__()
        self.config = config
        # frequencies as the reference's state dict holds them: [inputs, features / 2]
        self.coord_features = nn.Parameter(torch.empty(1, config.coord_feat_dim // 2))
        self.size_features = nn.Parameter(torch.empty(2, config.size_feat_dim // 2))
        self.coord_encoder = nn.Linear(config.coord_feat_dim, hidden_size)
        self.size_encoder = nn.Linear(config.size_feat_dim, hidden_size)
        self.coord_decoder = GeluMLP(hidden_size, config.inner_size, config.coord_bins)
        self.size_decoder = GeluMLP(hidden_size, config.inner_size, 2 * config.size_bins)

    def encode_coordinate(self, value: torch.Tensor) -> torch.Tensor:
        """Coordinates [N] in [0, 1] -> input embeddings [N, hidden]. The value is cast to the
        weights' dtype first, as the reference does."""
        w = self.coord_features
        return self.coord_encoder(fourier_features(value.reshape(-1, 1).to(w.dtype), w))

    def encode_size(self, wh: torch.Tensor) -> torch.Tensor:
        """Sizes [N, 2] (width, height) in (0, 1] -> input embeddings [N, hidden]."""
        w = self.size_features
        return self.size_encoder(fourier_features(wh.reshape(-1, 2).to(w.dtype), w))

    def coordinate_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.coord_decoder(hidden)  # [N, coord_bins]

    def size_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.size_decoder(hidden).view(-1, 2, self.config.size_bins)  # [N, (w, h), size_bins]

    def decode_coordinate(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] -> coordinates [N] float32 (greedy bin)."""
        return coordinate_from_bin(self.coordinate_logits(hidden).argmax(-1), self.config.coord_bins)

    def decode_size(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [N, hidden] -> sizes [N, 2] float32, columns (width, height) (greedy bins)."""
        return size_from_bin(self.size_logits(hidden).argmax(-1), self.config.size_bins)

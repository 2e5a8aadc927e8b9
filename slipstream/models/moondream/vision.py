"""Moondream 2's vision side: a SigLIP-style encoder run over every crop of an image, the local crops'
features stitched back into one grid, and the projection MLP to the text width.

Per crop: 14-px patches (flattened channel-major: channel, row, column) -> Linear -> + learned
position embedding -> pre-LN blocks (x + attn(ln1 x), then x + mlp(ln2 x); fused qkv with bias,
full attention, GELU(tanh) MLP) -> final LayerNorm. The global crop's grid is kept as is; the local
crops' grids are stitched, each dropping the `overlap_margin` patches it shares with a neighbour,
and average-pooled back to one crop's grid. The projection MLP reads [global, pooled local] per
position: `tokens_per_image` (729) embeddings of the text width.

Module names follow the public reference's state dict (`vision.blocks.0.attn.qkv`, ...).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.moondream.config import MoondreamVisionConfig


class GeluMLP(nn.Module):
    def __init__(self, dim: int, inner: int, out: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(inner, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _Attention(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)


class VisionBlock(nn.Module):
    def __init__(self, config: MoondreamVisionConfig):
        super().__init__()
        d, eps = config.hidden_size, config.layer_norm_eps
        self.heads = config.num_heads
        self.ln1 = nn.LayerNorm(d, eps=eps)
        self.attn = _Attention(d)
        self.ln2 = nn.LayerNorm(d, eps=eps)
        self.mlp = GeluMLP(d, config.intermediate_size, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [crops, patches, dim]
        n, t, d = x.shape
        q, k, v = (p.view(n, t, self.heads, d // self.heads).transpose(1, 2)
                   for p in self.attn.qkv(self.ln1(x)).chunk(3, dim=-1))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, d)
        x = x + self.attn.proj(a)
        return x + self.mlp(self.ln2(x))


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[N, C, H, W] -> [N, (H/p) * (W/p), C * p * p], patches row-major, each channel-major."""
    n, c, h, w = pixels.shape
    x = pixels.reshape(n, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(n, (h // patch) * (w // patch), c * patch * patch)


def stitch_crops(local: torch.Tensor, tiling: tuple[int, int], margin: int) -> torch.Tensor:
    """Local crop grids [rows * cols, g, g, D] -> one [H, W, D] grid: a crop keeps its outer margins
    only on the image border; inner margins come from the crop whose window holds them."""
    rows, cols = tiling
    g = local.shape[1]
    step = g - 2 * margin
    out = local.new_zeros(step * rows + 2 * margin, step * cols + 2 * margin, local.shape[-1])
    for i in range(rows * cols):
        r, c = divmod(i, cols)
        top = 0 if r == 0 else margin
        bottom = g if r == rows - 1 else g - margin
        left = 0 if c == 0 else margin
        right = g if c == cols - 1 else g - margin
        out[r * step + top: r * step + bottom, c * step + left: c * step + right] = local[i, top:bottom, left:right]
    return out


class VisionEncoder(nn.Module):
    def __init__(self, config: MoondreamVisionConfig):
        super().__init__()
        self.config = config
        d, p = config.hidden_size, config.patch_size
        self.patch_emb = nn.Linear(config.in_channels * p * p, d)
        self.pos_emb = nn.Parameter(torch.empty(1, config.tokens_per_image, d))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.num_layers))
        self.post_ln = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.proj_mlp = GeluMLP(2 * d, config.proj_inner_size, config.proj_out_size)

    def encode_crops(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, crop, crop] -> per-crop features [N, grid², vision width]."""
        x = self.patch_emb(patchify(pixels, self.config.patch_size)) + self.pos_emb
        for block in self.blocks:
            x = block(x)
        return self.post_ln(x)

    def project(self, features: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """Per-crop features (global first) -> [grid², text width] image embeddings."""
        g, d = self.config.grid, self.config.hidden_size
        local = features[1:].reshape(-1, g, g, d)
        stitched = stitch_crops(local, tiling, self.config.overlap_margin)
        pooled = F.adaptive_avg_pool2d(stitched.permute(2, 0, 1), (g, g)).permute(1, 2, 0).reshape(g * g, d)
        return self.proj_mlp(torch.cat([features[0], pooled], dim=-1))

    def encode(self, pixel_values: torch.Tensor, tiling: tuple[int, int]) -> torch.Tensor:
        """One image's crops [1 + rows * cols, 3, crop, crop] (from image.preprocess) -> its
        [tokens_per_image, text width] embeddings, on the encoder's device and dtype."""
        rows, cols = tiling
        if pixel_values.dim() != 4 or pixel_values.shape[0] != 1 + rows * cols:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} do not hold 1 + {rows}x{cols} crops")
        w = self.patch_emb.weight
        return self.project(self.encode_crops(pixel_values.to(device=w.device, dtype=w.dtype)), tiling)

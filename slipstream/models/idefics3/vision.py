"""Idefics3's vision tower (a SigLIP-style ViT) and connector, as one `vision` submodule of the decoder.

encode(tiles) -> one row per `<image>` placeholder, in prompt order: each tile's patch grid goes
through the ViT, then every scale x scale block of neighbouring patches is folded into one vector
(pixel shuffle) and projected, without bias, to the decoder's width. Module names follow the
checkpoint's `model.vision_model.*` (loader.py maps `model.connector.modality_projection.proj`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.idefics3.config import VisionConfig
from slipstream.models.idefics3.processor import Idefics3Processing


class Embeddings(nn.Module):
    """Patchify (a strided conv) plus a learned position per patch of the tile's grid. A tile whose
    valid area covers fewer patches stretches its patches over the full grid of positions."""

    def __init__(self, c: VisionConfig):
        super().__init__()
        self.patch = c.patch_size
        self.side = c.image_size // c.patch_size
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size)
        self.position_embedding = nn.Embedding(self.side ** 2, c.hidden_size,
                                               _weight=torch.empty(self.side ** 2, c.hidden_size))

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """[tiles, rows * cols] ids into the side x side table; a tile with h x w valid patches takes
        the bucket of i/h (row) and j/w (column) on the grid; padding patches take 0."""
        device = patch_mask.device
        n, rows, cols = patch_mask.shape
        edges = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)  # as transformers, in float32
        valid_h = patch_mask[:, :, 0].sum(1)
        valid_w = patch_mask[:, 0, :].sum(1)
        frac_h = torch.arange(rows, device=device, dtype=torch.float32)[None, :] * (1.0 / valid_h)[:, None]
        frac_w = torch.arange(cols, device=device, dtype=torch.float32)[None, :] * (1.0 / valid_w)[:, None]
        bucket_h = torch.bucketize(frac_h.clamp(max=1 - 1e-6), edges, right=True)
        bucket_w = torch.bucketize(frac_w.clamp(max=1 - 1e-6), edges, right=True)
        ids = (bucket_h[:, :, None] * self.side + bucket_w[:, None, :]).reshape(n, -1)
        return torch.where(patch_mask.reshape(n, -1), ids, torch.zeros_like(ids))

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [tiles, patches, hidden]
        return x + self.position_embedding(self.position_ids(patch_mask))


class Attention(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.heads = c.num_heads
        h = c.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor | None) -> torch.Tensor:
        n, t, h = x.shape

        def heads(p: nn.Linear) -> torch.Tensor:
            return p(x).view(n, t, self.heads, h // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj), heads(self.k_proj), heads(self.v_proj),
                                             attn_mask=key_bias)
        return self.out_proj(out.transpose(1, 2).reshape(n, t, h))


class MLP(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size)
        self.approximate = "tanh" if c.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class EncoderLayer(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.self_attn = Attention(c)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, key_bias: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_bias)
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(c) for _ in range(c.num_layers))


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[tiles, side*side, d] -> [tiles, (side/scale)^2, scale*scale*d]: output (i, j) concatenates the
    patches (i*scale + a, j*scale + b), a-major then b, each d wide."""
    n, t, d = x.shape
    side = int(round(t ** 0.5))
    s = scale
    x = x.view(n, side // s, s, side // s, s, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(n, (side // s) ** 2, s * s * d)


class Idefics3Vision(nn.Module):
    """The tower, its final LayerNorm and the connector. `processing` turns images into its input."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.connector = nn.Linear(config.hidden_size * config.scale_factor ** 2, config.text_hidden_size,
                                       bias=False)
        self.processing = Idefics3Processing.for_vision(config)

    @property
    def tokens_per_tile(self) -> int:
        return self.config.tokens_per_tile

    def encode(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[tiles, 3, H, W] pixels (and [tiles, H, W] valid-pixel mask) -> [tiles * tokens_per_tile,
        text hidden] embeddings on the module's device and dtype, tile after tile. Reads nothing
        back from the device: it only enqueues work (tests/test_idefics3_model.py, sync debug mode)."""
        w = self.connector.weight
        pixels = pixel_values.to(device=w.device, dtype=w.dtype)
        p = self.config.patch_size
        if pixel_attention_mask is None:
            patch_mask = torch.ones(pixels.shape[0], pixels.shape[2] // p, pixels.shape[3] // p,
                                    dtype=torch.bool, device=w.device)
        else:  # a patch is valid when any of its pixels is
            m = pixel_attention_mask.to(device=w.device, dtype=torch.bool)
            patch_mask = m.unflatten(1, (-1, p)).unflatten(3, (-1, p)).any(4).any(2)
        x = self.embeddings(pixels, patch_mask)
        key_bias = None
        if pixel_attention_mask is not None:  # padding patches are never attended to
            # always the bias (all zeros when nothing is padding): asking the device whether any
            # patch is padding would make the launching thread wait for it. Callers that know on
            # the host that every pixel is valid pass no mask (ModelRunner.launch_encoder).
            keys = patch_mask.reshape(patch_mask.shape[0], 1, 1, -1)
            key_bias = torch.zeros(keys.shape, dtype=x.dtype, device=x.device).masked_fill(
                ~keys, torch.finfo(x.dtype).min)
        for layer in self.encoder.layers:
            x = layer(x, key_bias)
        x = pixel_shuffle(self.post_layernorm(x), self.config.scale_factor)
        return self.connector(x).reshape(-1, self.config.text_hidden_size)

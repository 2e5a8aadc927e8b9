"""Rotary position embedding: the cos/sin tables and the reference rotation.

Its own module because the reference model (llama/model.py) and the fused rotary + KV-write kernel's
reference (rotary_kv_triton.py) both use it, and llama/model.py reaches that kernel through
llama/forward_triton.py: with the rotation in llama/model.py the three formed an import circle.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.models.config import ModelConfig


def partial_rotary_order(head_dim: int, rotary_dim: int) -> list[int]:
    """Partial rotary as a full one: position j of a reordered q/k head holds dim order[j]. The rotation
    pairs j with j + head_dim / 2; the first rotary_dim / 2 pairs get the rotary pairs (i, i + rotary_dim / 2),
    the others two pass-through dims, which the tables leave alone (cos 1, sin 0). q and k are reordered
    alike, so their dot products are the model's; v and the outputs are not touched."""
    r2, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return ([*range(r2), *range(rotary_dim, rotary_dim + p)]
            + [*range(r2, rotary_dim), *range(rotary_dim + p, head_dim)])


def reorder_heads(t, heads: int, order: list[int]):
    """Rows of a [heads * head_dim, ...] projection (or its bias) with each head's rows in `order`."""
    d = len(order)
    idx = torch.tensor(order, dtype=torch.long)
    return t.reshape(heads, d, *t.shape[1:])[:, idx].reshape(t.shape)


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class RotaryEmbedding(nn.Module):
    """Cos/sin tables for every position, indexed by token position (no per-step recompute)."""

    cos: torch.Tensor  # [max_position_embeddings, head_dim] buffers
    sin: torch.Tensor

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.rotary_dims  # (partial rotary: the tables' other columns are cos 1, sin 0, below)
        # Tables are computed on the CPU even while the model is built on the meta device (they are
        # not in checkpoints): real values, and no meta-tensor arithmetic (which imports torch._dynamo).
        cpu = torch.device("cpu")
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=cpu).float() / d))
        if config.rope_freq_factors is not None:  # Llama-3 / linear scaling, or a GGUF's rope_freqs
            inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32, device=cpu)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=cpu)
        freqs = torch.outer(pos, inv_freq)
        if config.rope_long_factors is not None:  # LongRoPE: each position by its own side of the switch,
            # the frequencies rounded as transformers rounds them: 1 / (factor * theta^(i / d))
            powers = config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=cpu).float() / d)
            for factors, lo, hi in ((config.rope_freq_factors, 0, config.rope_long_from),
                                    (config.rope_long_factors, config.rope_long_from, None)):
                inv = 1.0 / (torch.tensor(factors, dtype=torch.float32, device=cpu) * powers)
                freqs[lo:hi] = torch.outer(pos[lo:hi], inv)
        scale = config.rope_attention_factor
        cos, sin = (freqs.cos() * scale, freqs.sin() * scale) if scale != 1.0 else (freqs.cos(), freqs.sin())
        if d < config.head_dim:  # the pass-through pairs (partial_rotary_order)
            pad = (config.head_dim - d) // 2
            cos = torch.cat([cos, torch.ones(cos.shape[0], pad, device=cpu)], dim=-1)
            sin = torch.cat([sin, torch.zeros(sin.shape[0], pad, device=cpu)], dim=-1)
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat([sin, sin], dim=-1), persistent=False)

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype):
        """A function rotating (q [T, H, D], k [T, KVH, D]) at these token positions. The tables are
        gathered here, once per forward, not once per layer."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return lambda q, k: (rotate_half_reference(q, cos, sin), rotate_half_reference(k, cos, sin))

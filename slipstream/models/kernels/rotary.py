"""Rotary position embedding: the cos/sin tables and the reference rotation.

Its own module because the reference model (llama/model.py) and the fused rotary + KV-write kernel's
reference (rotary_kv_triton.py) both use it, and llama/model.py reaches that kernel through
llama/forward_triton.py: with the rotation in llama/model.py the three formed an import circle.
"""
from __future__ import annotations

import torch
from torch import nn

from slipstream.models.config import ModelConfig


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
        d = config.head_dim
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
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = config.rope_attention_factor
        self.register_buffer("cos", emb.cos() * scale if scale != 1.0 else emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin() * scale if scale != 1.0 else emb.sin(), persistent=False)

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype):
        """A function rotating (q [T, H, D], k [T, KVH, D]) at these token positions. The tables are
        gathered here, once per forward, not once per layer."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return lambda q, k: (rotate_half_reference(q, cos, sin), rotate_half_reference(k, cos, sin))

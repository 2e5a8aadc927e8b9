"""Moondream 2's text decoder (Phi-1.5 style) on slipstream's paged KV cache.

Per block: one LayerNorm, then a parallel residual x + attn(ln x) + mlp(ln x). Attention has a fused
qkv projection with bias, rotary on the first `rotary_dim` dims of each head only, and an output
projection with bias; the MLP is fc1 -> GELU(tanh) -> fc2, with biases. After the blocks: a final
LayerNorm and an lm_head with bias. Module names follow the public reference's state dict
(`text.blocks.0.attn.qkv`, `text.wte`, `text.post_ln`, `text.lm_head`).

It takes the same `ForwardBatch` and `KVCache` as the Llama family (slipstream/models/llama/model.py), so
the runtime drives it unchanged; `forward_hidden` also returns the last hidden state of the sampled
rows (before the final LayerNorm: what the reference's region heads read). Nothing here reads a
device value on the host, so a step can run inside a CUDA graph once the attention can.

The bidirectional BOS + image prefix is a property of the batch, not of the model: the planner
sets `AttentionMetadata.bidirectional_lens` (see attention.py and docs/moondream.md).

On the "triton" backend (the GPU path) only the attention changes: the paged attention kernel
(attention_triton.py, reading the device metadata and its bidirectional prefixes). The partial
rotary and the K/V write stay torch ops: the fused rotary + KV-write kernel rotates whole heads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.kernels.attention import paged_attention_reference, write_kv
from slipstream.models.kernels.attention_triton import paged_attention_triton
from slipstream.models.moondream.config import MoondreamTextConfig
from slipstream.models.moondream.vision import GeluMLP
from slipstream.models.kernels.rotary import rotate_half_reference

if TYPE_CHECKING:
    from slipstream.models.base import ForwardBatch, KVCache


class PartialRotary(nn.Module):
    """Cos/sin tables over rotary_dim dims, for every position.

    The reference rotates the halves (first half real, second half imaginary) and writes the result
    back interleaved; here it stays in halves. That is one fixed permutation of the rotated dims,
    applied alike to queries and keys, so every score q·k (and the output) is the same."""

    cos: torch.Tensor  # buffers
    sin: torch.Tensor

    def __init__(self, config: MoondreamTextConfig):
        super().__init__()
        self.rotary_dim = d = config.rotary_dim
        # on the CPU: real values even when the model is built on the meta device; in float64, then
        # rounded once to the model dtype (model.to), so a float64 model gets exact tables
        cpu, f64 = torch.device("cpu"), torch.float64
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=f64, device=cpu) / d))
        freqs = torch.outer(torch.arange(config.max_position_embeddings, dtype=f64, device=cpu), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def for_positions(self, positions: torch.Tensor, dtype: torch.dtype):
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        r = self.rotary_dim

        def rotate(x: torch.Tensor) -> torch.Tensor:  # [T, heads, head_dim]
            return torch.cat([rotate_half_reference(x[..., :r], cos, sin), x[..., r:]], dim=-1)

        return rotate


class _Attention(nn.Module):
    def __init__(self, config: MoondreamTextConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        d = config.hidden_size
        self.qkv = nn.Linear(d, (self.heads + 2 * self.kv_heads) * self.head_dim)
        self.proj = nn.Linear(d, d)
        self.compute_dtype: torch.dtype | None = None  # float64: batch/chunk-invariant (attention.py)
        self.backend = "reference"  # or "triton": MoondreamForCausalLM.set_kernel_backend

    def forward(self, x: torch.Tensor, batch: "ForwardBatch", kv: "KVCache", rotate) -> torch.Tensor:
        t = x.shape[0]
        qd, kd = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([qd, kd, kd], dim=-1)
        q = rotate(q.view(t, self.heads, self.head_dim))
        k = rotate(k.view(t, self.kv_heads, self.head_dim))
        k_cache, v_cache = kv.k[self.layer], kv.v[self.layer]
        write_kv(k_cache, batch.kv_indices, k)
        write_kv(v_cache, batch.kv_indices, v.reshape(t, self.kv_heads, self.head_dim))
        out = torch.zeros_like(q)  # padding rows stay finite
        if self.backend == "triton":
            m: Any = batch.attn.on_device  # (set on the triton backend: the runner uploads it)
            paged_attention_triton(q, k_cache, v_cache, m.query_start, m.kv_lens, m.page_table, kv.page_size,
                                   m.max_q_len, out, blocks=m.blocks, bidirectional_lens=m.bidirectional_lens)
        else:
            paged_attention_reference(q, k_cache, v_cache, batch.attn, out, self.compute_dtype)
        return self.proj(out.view(t, qd))


class MoondreamTextBlock(nn.Module):
    def __init__(self, config: MoondreamTextConfig, layer: int):
        super().__init__()
        self.ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attn = _Attention(config, layer)
        self.mlp = GeluMLP(config.hidden_size, config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor, batch: "ForwardBatch", kv: "KVCache", rotate) -> torch.Tensor:
        h = self.ln(x)
        return x + self.attn(h, batch, kv, rotate) + self.mlp(h)


class MoondreamText(nn.Module):
    def __init__(self, config: MoondreamTextConfig):
        super().__init__()
        self.config = config
        # a bare parameter (the reference's `text.wte`); uninitialised: weights are always loaded
        self.wte = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size))
        self.blocks = nn.ModuleList(MoondreamTextBlock(config, i) for i in range(config.num_layers))
        self.post_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)
        self.rope = PartialRotary(config)

    def embed(self, batch: "ForwardBatch") -> torch.Tensor:
        """Token embeddings, with the rows in `batch.embed_rows` replaced by `batch.embeds` (image
        features; later region values). Both fields come with issue 30's ForwardBatch and may be
        absent on an older one."""
        x = F.embedding(batch.input_ids, self.wte)
        rows, embeds = getattr(batch, "embed_rows", None), getattr(batch, "embeds", None)  # (set together)
        if rows is not None:
            x = x.index_copy(0, rows, cast(torch.Tensor, embeds).to(x.dtype))
        return x

    def hidden(self, batch: "ForwardBatch", kv: "KVCache") -> torch.Tensor:
        """The last block's output for every token row, before the final LayerNorm."""
        return self.blocks_forward(self.embed(batch), batch, kv)

    def blocks_forward(self, x: torch.Tensor, batch: "ForwardBatch", kv: "KVCache") -> torch.Tensor:
        """The blocks over input embeddings x [T, hidden]."""
        rotate = self.rope.for_positions(batch.positions, x.dtype)
        for block in self.blocks:
            x = block(x, batch, kv, rotate)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.post_ln(hidden)).float()

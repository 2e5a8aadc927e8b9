"""Reference attention over a paged KV cache: clear, per-sequence, and batch-invariant.

The KV cache stores keys and values for every token in fixed-size pages; a sequence's page-table
row lists its pages in order. Here we gather each sequence's pages back into a contiguous
[kv_len, kv_heads, head_dim] tensor and run SDPA on it. One SDPA call per sequence keeps every
row's arithmetic independent of which other sequences share the step. How a prompt is chunked
still changes the kernel's reduction order (a masked chunk vs one causal pass), so with
`compute_dtype=torch.float64` the math runs in double precision and is rounded back: reordering
noise (~1e-16) vanishes in the rounding, and outputs no longer depend on batch composition or
chunk boundaries (the pipelined loop batches differently from the blocking one and must still
produce identical greedy tokens). The GPU kernel is slipstream/models/attention_triton.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Host-side description of which query tokens belong to which sequence.

    query_start[s]:query_start[s+1] are sequence s's query tokens in the flat batch; they are the
    last tokens of its context, so token i of the chunk sits at kv_len - q_len + i.
    """

    query_start: list[int]
    kv_lens: list[int]
    page_tables: "list[list[int]] | torch.Tensor"  # a row per sequence (lists, or a [S, P] tensor)
    page_size: int
    on_device: "DeviceAttentionMetadata | None" = None  # what GPU kernels read (and graphs capture)

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)


@dataclass
class DeviceAttentionMetadata:
    """The same description as device tensors: query_start [S+1], kv_lens [S], page_table [S, P].

    `max_q_len` is a host bound on chunk lengths, used only to size a kernel grid."""

    query_start: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor
    max_q_len: int


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Scatter [T, kv_heads, head_dim] into the flat [slots, kv_heads, head_dim] cache."""
    cache.index_copy_(0, slot_mapping, values)


def gather_slots(pages, kv_len: int, page_size: int, device: torch.device) -> torch.Tensor:
    """Flat KV slots of a sequence's first kv_len tokens; `pages` a list or a page-table tensor row."""
    page_idx = torch.as_tensor(pages[: (kv_len + page_size - 1) // page_size], dtype=torch.long, device=device)
    offsets = torch.arange(page_size, dtype=torch.long, device=device)
    return (page_idx[:, None] * page_size + offsets).reshape(-1)[:kv_len]


def paged_attention_reference(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,  # [T, heads, head_dim]; rows of padding tokens are left untouched
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    cd = compute_dtype or q.dtype
    for s in range(meta.num_seqs):
        q_lo, q_hi = meta.query_start[s], meta.query_start[s + 1]
        q_len, kv_len = q_hi - q_lo, meta.kv_lens[s]
        slots = gather_slots(meta.page_tables[s], kv_len, meta.page_size, q.device)
        k = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0).to(cd)  # [1, kv_heads, L, D]
        v = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0).to(cd)
        qs = q[q_lo:q_hi].transpose(0, 1).unsqueeze(0).to(cd)  # [1, heads, q_len, D]
        if q_len == 1:
            o = F.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
        elif q_len == kv_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True)
        else:  # a later prefill chunk: query i may see keys up to its own position
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
        out[q_lo:q_hi] = o[0].transpose(0, 1)
    return out

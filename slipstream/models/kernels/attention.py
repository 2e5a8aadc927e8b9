"""Reference attention over a paged KV cache: clear, per-sequence, and batch-invariant.

The KV cache stores keys and values for every token in fixed-size pages; a sequence's page-table
row lists its pages in order. Here we gather each sequence's pages back into a contiguous
[kv_len, kv_heads, head_dim] tensor and run SDPA on it. One SDPA call per sequence keeps every
row's arithmetic independent of which other sequences share the step. How a prompt is chunked
still changes the kernel's reduction order (a masked chunk vs one causal pass), so with
`compute_dtype=torch.float64` the math runs in double precision and is rounded back: reordering
noise (~1e-16) vanishes in the rounding, and outputs no longer depend on batch composition or
chunk boundaries (the pipelined loop batches differently from the blocking one and must still
produce identical greedy tokens). The GPU kernel is slipstream/models/kernels/attention_triton.py.

Without invariance (the default), a step whose sequences all decode one token runs as one batched
SDPA call per layer over keys padded to the longest context (a mask hides the padding), and the
KV indices of every sequence are built once per forward, not once per layer
(`AttentionMetadata.cpu_plan`).
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
    cpu_plan: "CPUAttentionPlan | None" = None  # built on first use by the reference path, shared by layers
    # Per sequence, how many leading positions attend to each other both ways (Moondream's BOS + image
    # prefix); None or 0 is plain causal. Honoured only when a chunk holds the whole prefix (a later
    # key cannot be attended to before it is computed); the triton kernel reads its device copy,
    # DeviceAttentionMetadata.bidirectional_lens.
    bidirectional_lens: "list[int] | None" = None

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)


@dataclass
class CPUAttentionPlan:
    """Index tensors of one forward, built once and used by every layer.

    kv_indices[s]: sequence s's KV indices in order. For an all-decode step (one query per
    sequence), `padded` [S, max_kv] holds the same indices padded with the sequence's first one, and
    `mask` [S, 1, 1, max_kv] is False on the padding (None when every sequence has the same length).
    The padding repeats a written KV index because the pool is uninitialised: a masked key still enters
    the kernel's arithmetic with weight 0, and 0 × NaN garbage would be NaN."""

    kv_indices: list[torch.Tensor]
    padded: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    window_masks: "dict[int, torch.Tensor] | None" = None  # `mask` with a sliding window, by window


def _window_mask(plan: CPUAttentionPlan, meta: AttentionMetadata, window: int, device: torch.device) -> torch.Tensor:
    """The padded decode step's mask for a sliding window: key j of a sequence of n keys is seen when
    n - window <= j < n. Built once per window per forward (the layers of one window share it)."""
    if plan.window_masks is None:
        plan.window_masks = {}
    if window not in plan.window_masks:
        assert plan.padded is not None
        lens = torch.tensor(meta.kv_lens, device=device)[:, None]
        j = torch.arange(plan.padded.shape[1], device=device)[None, :]
        plan.window_masks[window] = ((j < lens) & (j >= lens - window))[:, None, None, :]
    return plan.window_masks[window]


def window_mask(q_len: int, kv_len: int, window: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: the query at position p (the chunk's last positions) sees keys (p - window, p]."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


def cpu_plan(meta: AttentionMetadata, device: torch.device, batched: bool) -> CPUAttentionPlan:
    if meta.cpu_plan is None:
        kv_indices = [gather_kv_indices(meta.page_tables[s], meta.kv_lens[s], meta.page_size, device)
                 for s in range(meta.num_seqs)]
        plan = CPUAttentionPlan(kv_indices)
        if batched and meta.num_seqs > 1 and meta.query_start[-1] == meta.num_seqs:
            longest = max(meta.kv_lens)
            plan.padded = torch.empty(meta.num_seqs, longest, dtype=torch.long, device=device)
            for s, idx in enumerate(kv_indices):
                plan.padded[s, : idx.numel()] = idx
                plan.padded[s, idx.numel():] = idx[0]
            if min(meta.kv_lens) < longest:
                lens = torch.tensor(meta.kv_lens, device=device)
                plan.mask = (torch.arange(longest, device=device)[None, :] < lens[:, None])[:, None, None, :]
        meta.cpu_plan = plan
    return meta.cpu_plan


@dataclass
class DeviceAttentionMetadata:
    """The same description as device tensors: query_start [S+1], kv_lens [S], page_table [S, P].

    `max_q_len` is a host bound on chunk lengths, used only to size a kernel grid; `blocks`, when set,
    is the attention kernel's [2, programs] table of query blocks (attention_blocks.query_blocks),
    which sizes the grid instead, by the step's token bucket: what a graph of mixed steps needs.
    `bidirectional_lens` [S]: AttentionMetadata.bidirectional_lens on the device (None: all causal,
    and the kernel compiled without the prefix test)."""

    query_start: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor
    max_q_len: int
    blocks: torch.Tensor | None = None
    bidirectional_lens: torch.Tensor | None = None


def write_kv(cache: torch.Tensor, kv_indices: torch.Tensor, values: torch.Tensor) -> None:
    """Scatter [T, kv_heads, head_dim] into the flat [pages * page_size, kv_heads, head_dim] cache at `kv_indices`."""
    cache.index_copy_(0, kv_indices, values)


def gather_kv_indices(pages, kv_len: int, page_size: int, device: torch.device) -> torch.Tensor:
    """KV indices of a sequence's first kv_len tokens; `pages` a list or a page-table tensor row."""
    page_idx = torch.as_tensor(pages[: (kv_len + page_size - 1) // page_size], dtype=torch.long, device=device)
    offsets = torch.arange(page_size, dtype=torch.long, device=device)
    return (page_idx[:, None] * page_size + offsets).reshape(-1)[:kv_len]


def paged_attention_reference(
    q: torch.Tensor,  # [T, heads, head_dim]
    k_cache: torch.Tensor,  # [pages * page_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,  # [T, heads, head_dim]; rows of padding tokens are left untouched
    compute_dtype: torch.dtype | None = None,
    window: int | None = None,  # sliding window: a query at position p sees keys (p - window, p]
    scale: float | None = None,  # the scores' factor (None: head_dim ** -0.5)
) -> torch.Tensor:
    cd = compute_dtype or q.dtype
    # Invariance needs each sequence's arithmetic alone (a padded batch changes the reduction).
    plan = cpu_plan(meta, q.device, batched=compute_dtype is None)
    if window is not None and max(meta.kv_lens, default=0) <= window:
        window = None  # every key is inside every query's window
    if plan.padded is not None:  # (one query per sequence: a prefix never changes its mask)
        mask = plan.mask if window is None else _window_mask(plan, meta, window, q.device)
        return _decode_batched(q, k_cache, v_cache, plan, out, mask, scale)
    prefixes = _bidirectional_prefixes(meta)
    for s in range(meta.num_seqs):
        q_lo, q_hi = meta.query_start[s], meta.query_start[s + 1]
        q_len, kv_len = q_hi - q_lo, meta.kv_lens[s]
        kv_indices = plan.kv_indices[s]
        k = k_cache.index_select(0, kv_indices).transpose(0, 1).unsqueeze(0).to(cd)  # [1, kv_heads, L, D]
        v = v_cache.index_select(0, kv_indices).transpose(0, 1).unsqueeze(0).to(cd)
        qs = q[q_lo:q_hi].transpose(0, 1).unsqueeze(0).to(cd)  # [1, heads, q_len, D]
        if window is not None and kv_len > window:
            mask = window_mask(q_len, kv_len, window, q.device)
            if prefixes[s]:
                mask &= bidirectional_prefix_mask(q_len, kv_len, prefixes[s], q.device)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
        elif prefixes[s]:
            mask = bidirectional_prefix_mask(q_len, kv_len, prefixes[s], q.device)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
        elif q_len == 1:
            o = F.scaled_dot_product_attention(qs, k, v, enable_gqa=True, scale=scale)
        elif q_len == kv_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True, scale=scale)
        else:  # a later prefill chunk: query i may see keys up to its own position
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
        out[q_lo:q_hi] = o[0].transpose(0, 1)
    return out


def _bidirectional_prefixes(meta: AttentionMetadata) -> list[int]:
    """Per sequence, the bidirectional prefix length this chunk must honour: 0 where plain causal
    attention gives the same result (no prefix, or the chunk's queries all sit past it). Raises
    ValueError for a chunk that has queries inside a prefix whose end it has not reached yet."""
    if not meta.bidirectional_lens:
        return [0] * meta.num_seqs
    if len(meta.bidirectional_lens) != meta.num_seqs:
        raise ValueError(f"bidirectional_lens has {len(meta.bidirectional_lens)} entries for {meta.num_seqs} sequences")
    out = []
    for s, prefix in enumerate(meta.bidirectional_lens):
        q_len, kv_len = meta.query_start[s + 1] - meta.query_start[s], meta.kv_lens[s]
        first = kv_len - q_len  # position of the chunk's first query
        if prefix <= 1 or first >= prefix or q_len == 0:
            out.append(0)
        elif kv_len < prefix:
            raise ValueError(f"sequence {s}: a chunk ending at {kv_len} splits its bidirectional prefix of "
                             f"{prefix} positions; the prefix must be computed in one chunk")
        else:
            out.append(prefix)
    return out


def bidirectional_prefix_mask(q_len: int, kv_len: int, prefix: int, device: torch.device) -> torch.Tensor:
    """[q_len, kv_len] bool: query at position p sees key j when j <= p, or when both lie in the prefix."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    return (k_pos <= q_pos) | ((q_pos < prefix) & (k_pos < prefix))


def _decode_batched(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: CPUAttentionPlan,
                    out: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """One query per sequence, all sequences in one SDPA call over padded, masked keys."""
    padded = plan.padded
    assert padded is not None  # (built for a decode-only step: _decode_batched's only caller)
    n, longest = padded.shape
    flat = padded.view(-1)  # index_select of KV indices: several times faster than advanced indexing here
    k = k_cache.index_select(0, flat).view(n, longest, *k_cache.shape[1:]).transpose(1, 2)  # [S, kv_heads, L, D]
    v = v_cache.index_select(0, flat).view(n, longest, *v_cache.shape[1:]).transpose(1, 2)
    o = F.scaled_dot_product_attention(q[:n].unsqueeze(2), k, v, attn_mask=mask, enable_gqa=True, scale=scale)
    out[:n] = o[:, :, 0]
    return out

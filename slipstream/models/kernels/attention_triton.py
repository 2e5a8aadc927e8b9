"""Paged attention as one Triton kernel: the GPU counterpart of `paged_attention_reference`.

What it computes: for every sequence s of a flat batch, its query tokens
`q[query_start[s]:query_start[s+1]]` are the last q_len tokens of a context of `kv_lens[s]` tokens,
so query i sits at position kv_len - q_len + i and attends causally to keys 0..that position
(decode is q_len 1, a prefill chunk q_len <= kv_len). Query head h reads kv head
h // (heads // kv_heads) (GQA); scores are scaled by 1/sqrt(head_dim).

With `bidirectional_lens` ([S] device tensor; Moondream's BOS + image prefix) a query at position
p < prefix also sees keys j < prefix (the reference's `bidirectional_prefix_mask`). The prefix is
clamped to kv_len: the planner computes a prefix in one chunk, so a chunk with a query inside it
reaches its end (the reference path refuses the other case; this kernel reads no values on the
host, so it trusts the planner). Without it the flag BIDI is a constexpr False and text models
compile the plain causal kernel unchanged.

Layout: q, out are [T, heads, head_dim]; k_cache, v_cache are one layer's flat
[N, kv_heads, head_dim] cache, where a key's KV index = page * page_size + offset and row s of page_table
[S, P] lists sequence s's pages in order. One program handles BLOCK_M queries of one (sequence,
head): it walks the context in blocks of BLOCK_N keys, resolving each key's KV index through the page
table, with an online (flash-attention) softmax accumulated in fp32, and stops at the causal limit
of its query block.

Two grids. By default a program is (sequence, head, query block) and the grid is
(S, heads, ceil(max_q_len / BLOCK_M)): `max_q_len` is a host int, fine for eager steps and for
decode graphs (always 1), but a graph of mixed steps would bake one step's longest chunk into every
replay. With `blocks` (a [2, P] device table: row 0 the sequence, row 1 the first query of each
program's block; built on the host by `query_blocks`, uploaded with the step) the grid is
(P, heads) with P = `num_query_programs(T, S)`, a bound that depends only on the token and
sequence counts: a graph captured for T tokens serves every step of at most T tokens. Both grids
cut each sequence into the same query blocks, so their outputs are bitwise equal.

Why it is graph-capturable: the wrapper reads only shapes and host ints to size the grid and
never a device value; sequence boundaries, context lengths, pages and the block table are read by
the kernel itself, so a captured launch replays correctly after the metadata tensors are updated
in place. It allocates nothing. Programs past a sequence's q_len (padding sequences with q_len 0,
the tail of max_q_len, table entries past the last block) exit without writing, so rows past
query_start[S] stay untouched.

On CPU tensors the kernel runs in Triton's interpreter (numpy), which is how the tests check it
without a GPU.
"""
import math

import torch

# the program table (attention_blocks.query_blocks) is built on the host, by code that must not need triton
from slipstream.models.kernels.attention_blocks import BLOCK_M
from slipstream.models.kernels.triton_jit import (MAX_COMBINE, SUM_COMBINE, interpreted, jitted, next_power_of_2,
                                                 cdiv, require_triton, tl, triton)

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    def _paged_attention_kernel(
        Q, K, V, O, QS, KVL, PT, BT, BL,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_pt,
        stride_bt, qk_scale, page_size,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FLAT: tl.constexpr,
        BIDI: tl.constexpr,
    ):
        h = tl.program_id(1)
        if FLAT:  # program -> (sequence, first query) from the block table
            # (not `p`: the loop below reuses that name for a tile, which the compiler rejects)
            prog = tl.program_id(0)
            s = tl.load(BT + prog).to(tl.int64)
            m_start = tl.load(BT + stride_bt + prog).to(tl.int64)
        else:
            s = tl.program_id(0)
            m_start = tl.program_id(2) * BLOCK_M
        q_lo = tl.load(QS + s).to(tl.int64)
        q_len = tl.load(QS + s + 1).to(tl.int64) - q_lo
        kv_len = tl.load(KVL + s).to(tl.int64)
        if m_start < q_len:  # grid is sized by max_q_len; shorter (or padding) sequences stop here
            offs_m = m_start + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            m_mask = offs_m < q_len
            d_mask = offs_d < HEAD_DIM
            q_pos = kv_len - q_len + offs_m
            kvh = h // GROUP
            tok = q_lo + offs_m
            q = tl.load(Q + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.full([BLOCK_M], 0.0, tl.float32)
            acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
            # keys past the block's last query position are masked for every row: skip them
            hi = tl.minimum(kv_len, kv_len - q_len + m_start + BLOCK_M)
            if BIDI:  # a query inside the prefix sees the whole prefix
                prefix = tl.minimum(tl.load(BL + s).to(tl.int64), kv_len)
                hi = tl.maximum(hi, prefix)
            for n0 in range(0, hi, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < hi
                page = tl.load(PT + s * stride_pt + offs_n // page_size, mask=n_mask, other=0).to(tl.int64)
                kv_index = page * page_size + offs_n % page_size
                kv_mask = n_mask[:, None] & d_mask[None, :]
                k = tl.load(K + kv_index[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                            mask=kv_mask, other=0.0)
                qk = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)
                # scores in log2 units so exp2 can be used
                visible = offs_n[None, :] <= q_pos[:, None]
                if BIDI:
                    visible = visible | ((q_pos[:, None] < prefix) & (offs_n[None, :] < prefix))
                qk = tl.where(visible & n_mask[None, :], qk * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.reduce(qk, 1, MAX_COMBINE))
                alpha = tl.math.exp2(m_i - m_new)
                p = tl.math.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
                v = tl.load(V + kv_index[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                            mask=kv_mask, other=0.0)
                pv = tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            out = acc / l_i[:, None]
            tl.store(O + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                     mask=m_mask[:, None] & d_mask[None, :])


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                           kv_lens: torch.Tensor, page_table: torch.Tensor, page_size: int, max_q_len: int,
                           out: torch.Tensor, blocks: torch.Tensor | None = None,
                           bidirectional_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Write attention for every query token into `out` (see the module docstring) and return it.

    Only shapes, dtypes and devices are checked here (never values: this must stay graph-capturable);
    `max_q_len` must bound every q_len, and q_len <= kv_len must hold for each sequence. `blocks`:
    the [2, P] program table of `query_blocks` (then `max_q_len` is not used). `bidirectional_lens`:
    [S] int32/int64, each sequence's bidirectional prefix length (0: plain causal)."""
    require_triton("paged_attention_triton")
    if q.dim() != 3 or out.shape != q.shape or k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q, out [T, heads, head_dim] and k/v caches [N, kv_heads, head_dim]; got "
                         f"q {tuple(q.shape)}, out {tuple(out.shape)}, k {tuple(k_cache.shape)}, "
                         f"v {tuple(v_cache.shape)}")
    if q.dtype not in _DTYPES or any(t.dtype != q.dtype for t in (k_cache, v_cache, out)):
        raise TypeError(f"q, k_cache, v_cache and out must share one dtype of {_DTYPES}; got "
                        f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}, {out.dtype}")
    _, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != head_dim or kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q has {heads} heads of dim {head_dim}; the cache has {kv_heads} kv heads of dim "
                         f"{k_cache.shape[2]} (heads must be a multiple of kv heads, dims must match)")
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, out)):
        raise ValueError("q, k_cache, v_cache and out need a contiguous last (head_dim) dimension")
    num_seqs = kv_lens.shape[0] if kv_lens.dim() == 1 else -1
    if (query_start.dim() != 1 or page_table.dim() != 2 or num_seqs < 0
            or query_start.shape[0] != num_seqs + 1 or page_table.shape[0] != num_seqs):
        raise ValueError(f"expected query_start [S+1], kv_lens [S], page_table [S, P]; got {tuple(query_start.shape)}, "
                         f"{tuple(kv_lens.shape)}, {tuple(page_table.shape)}")
    if any(t.dtype not in _INDEX_DTYPES for t in (query_start, kv_lens, page_table)):
        raise TypeError("query_start, kv_lens and page_table must be int32 or int64")
    if blocks is not None and (blocks.dim() != 2 or blocks.shape[0] != 2 or blocks.dtype not in _INDEX_DTYPES
                               or blocks.stride(1) != 1):
        raise ValueError(f"blocks must be a [2, P] int32/int64 table with contiguous rows, got "
                         f"{tuple(blocks.shape)} {blocks.dtype}")
    if bidirectional_lens is not None and (bidirectional_lens.shape != kv_lens.shape
                                           or bidirectional_lens.dtype not in _INDEX_DTYPES):
        raise ValueError(f"bidirectional_lens must be an int32/int64 [S] tensor like kv_lens, got "
                         f"{tuple(bidirectional_lens.shape)} {bidirectional_lens.dtype}")
    if any(t.device != q.device for t in (k_cache, v_cache, out, query_start, kv_lens, page_table)
           ) or any(t is not None and t.device != q.device for t in (blocks, bidirectional_lens)):
        raise ValueError("all tensors must be on q's device")
    if page_size <= 0 or max_q_len < 0:
        raise ValueError(f"page_size must be positive and max_q_len non-negative; got {page_size}, {max_q_len}")
    if num_seqs == 0 or q.shape[0] == 0 or (max_q_len == 0 if blocks is None else blocks.shape[1] == 0):
        return out
    interpret = interpreted(q)
    kernel = jitted(_paged_attention_kernel, interpret)
    # the interpreter's tl.dot multiplies bfloat16's raw uint16 bits (numpy has no bf16): upcast there,
    # which is exact; compiled code keeps bf16 operands on the tensor cores
    dot_dtype = tl.float32 if interpret and q.dtype == torch.bfloat16 else _TL_DTYPES[q.dtype]
    block_d = max(16, next_power_of_2(head_dim))
    # the K/V gathers hold a whole [BLOCK_N, BLOCK_D] tile per step in registers; these sizes compile
    # for sm_90 without spills (checked with cuobjdump -res-usage for head dims 64/128/256)
    block_n = 64 if q.dtype != torch.float32 and block_d <= 128 else 32
    if blocks is None:
        grid = (num_seqs, heads, cdiv(max_q_len, BLOCK_M))
    else:
        grid = (blocks.shape[1], heads, 1)
    kernel[grid](
        q, k_cache, v_cache, out, query_start, kv_lens, page_table, page_table if blocks is None else blocks,
        kv_lens if bidirectional_lens is None else bidirectional_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), 0 if blocks is None else blocks.stride(0),
        _LOG2E / math.sqrt(head_dim), page_size,
        HEAD_DIM=head_dim, GROUP=heads // kv_heads, DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if q.dtype == torch.float32 else None,  # exact fp32, not tf32
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_D=block_d, FLAT=blocks is not None,
        BIDI=bidirectional_lens is not None,
        num_warps=4 if block_d <= 64 else 8,
    )
    return out

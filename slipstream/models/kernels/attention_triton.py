"""Paged attention in Triton: the GPU counterpart of `paged_attention_reference`.

What it computes: for every sequence s of a flat batch, its query tokens
`q[query_start[s]:query_start[s+1]]` are the last q_len tokens of a context of `kv_lens[s]` tokens,
so query i sits at position kv_len - q_len + i and attends causally to keys 0..that position
(decode is q_len 1, a prefill chunk q_len <= kv_len). Query head h reads kv head
h // (heads // kv_heads) (GQA); scores are scaled by 1/sqrt(head_dim).

With `window` (a host int; Mistral, Qwen2/3's sliding layers) a query at position p sees only keys
(p - window, p]: the tiles wholly before a query sub-block's first window are skipped, and a row with
no key yet in a tile (or a decode split) adds weight 0 (the flag WINDOWED compiles that in).

With `bidirectional_lens` ([S] device tensor; Moondream's BOS + image prefix) a query at position
p < prefix also sees keys j < prefix (the reference's `bidirectional_prefix_mask`). The prefix is
clamped to kv_len: the planner computes a prefix in one chunk, so a chunk with a query inside it
reaches its end (the reference path refuses the other case; this kernel reads no values on the
host, so it trusts the planner). Without it the flag BIDI is a constexpr False and text models
compile the plain causal kernel unchanged.

Layout: q, out are [T, heads, head_dim]; k_cache, v_cache are one layer's flat
[N, kv_heads, head_dim] cache, where a key's KV index = page * page_size + offset and row s of
page_table [S, P] lists sequence s's pages in order.

GQA grouping: one program handles one (sequence, kv head, query block) and the GROUP query heads
that share the kv head together: the rows of its tile are (query, head in group) pairs, so each K/V
tile is loaded once per kv head, not once per query head. It walks the context in tiles of BLOCK_N
keys, resolving each key's KV index through the page table, with an online (flash-attention)
softmax in fp32, and stops at the causal limit of its queries. A query block is QUERY_BLOCK (16)
queries, cut into sub-blocks of QB queries so a tile has at most 64 rows (16-bit, head_dim <= 64)
or 16 (QB * GROUP, padded to a power of two >= 16, the least `tl.dot` takes): what sm_90 holds in
registers without spilling. Decode (the host's max_q_len == 1 on the sequence grid) has one query
per program: its rows are just the GROUP heads.

Three grids, all sized from host ints only:
  - sequence grid (S, kv_heads, ceil(max_q_len / 16)): eager steps and decode graphs (max_q_len 1);
  - flat grid (P, kv_heads) with `blocks`, a [2, P] device table (row 0 the sequence, row 1 the
    first query of each program's block; `attention_blocks.query_blocks`) and P =
    `num_query_programs(T, S)`, a bound of the token and sequence counts: a graph captured for T
    tokens serves every step of at most T tokens. Both grids cut each sequence into the same query
    blocks and sub-blocks, so their outputs are bitwise equal (prefill; a decode step on the
    sequence grid uses the one-query tiles);
  - split grid (S, kv_heads, splits) for decode when S * kv_heads programs would leave most SMs idle
    (flash-decoding; `decode_splits` picks `splits` from the SM count, S, kv_heads and the page
    table's width). A sequence's split length is computed on the device from its kv_len:
    max(MIN_SPLIT, ceil(kv_len / splits) rounded up to BLOCK_N); programs past its last split exit.
    A sequence with one split writes its output directly (bitwise what the sequence grid writes);
    the others write fp32 partials (unnormalised accumulator, running max, sum) to a workspace, and
    `_merge_splits_kernel` combines them in split order with a fixed reduction tree: no atomics, the
    same bits on every replay. A context longer than MIN_SPLIT therefore rounds differently with
    another `splits` (a host int fixed per graph), as a GEMM's output does with its row count.

Why it is graph-capturable: the wrapper reads only shapes and host ints (and the device's SM count)
to size the grids and never a device value; sequence boundaries, context lengths, pages and the
block table are read by the kernels, so a captured launch replays correctly after the metadata
tensors are updated in place. It allocates only the split workspace (inside a capture, from the
graph's pool). Programs past a sequence's q_len (padding sequences with q_len 0, the tail of
max_q_len, table entries past the last block) exit without writing, so rows past query_start[S] stay
untouched.

`impl="per_head"` launches the kernel this one replaced (attention_per_head_triton.py), for the
benchmark and the tests only. On CPU tensors the kernels run in Triton's interpreter (numpy), which
is how the tests check them without a GPU.
"""
import math

import torch

from slipstream.models.kernels import attention_per_head_triton as per_head
# the program table (attention_blocks.query_blocks) is built on the host, by code that must not need triton
from slipstream.models.kernels.attention_blocks import BLOCK_M as QUERY_BLOCK
from slipstream.models.kernels.triton_jit import (MAX_COMBINE, SUM_COMBINE, cdiv, interpreted, jitted, next_power_of_2,
                                                  require_triton, tl, triton)

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
IMPLS = ("grouped", "per_head")
# keys: a shorter split would save less than its partial's write and merge cost (a guess until
# tools/gpu/bench_attention_cuda.py has run)
MIN_SPLIT = 256
MAX_SPLITS = 32  # the merge holds [MAX_SPLITS, head_dim] partials in registers
MAX_TILE_ROWS = 64  # (query, head) rows of a 16-bit prefill tile at head_dim <= 64 (16 otherwise)
CPU_SMS = 132  # the interpreter plans splits as an H100 would


def decode_splits(num_seqs: int, kv_heads: int, max_keys: int, sms: int) -> int:
    """Splits per (sequence, kv head) of a decode step: enough programs for ~2 per SM when there
    are fewer (sequence, kv head) pairs than SMs, never more than a context of `max_keys` keys
    (the page table's width) can fill with MIN_SPLIT-key splits. 1: no split."""
    programs = num_seqs * kv_heads
    if programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), -(-max_keys // MIN_SPLIT), MAX_SPLITS))


def tiles(group: int, head_dim: int, dtype: torch.dtype, decode: bool) -> dict:
    """The grouped kernel's tile constexprs and warps for one launch kind."""
    block_d = max(16, next_power_of_2(head_dim))
    half = dtype != torch.float32
    if decode:
        q_block = qb = 1
    else:  # rows x head_dim within what sm_90 holds in registers without spills (tools/gpu/kernel_resources.py)
        budget = max(1, (MAX_TILE_ROWS if half and block_d <= 64 else 16) // group)
        q_block, qb = QUERY_BLOCK, min(QUERY_BLOCK, 1 << (budget.bit_length() - 1))
    block_m = max(16, next_power_of_2(qb * group))
    # the K/V gathers hold a [BLOCK_N, BLOCK_D] tile (and its 64-bit addresses) in registers; decode
    # tiles have few rows, so at head_dim 64 they take twice the keys per step (half the dependent
    # page-table -> K -> V round trips)
    block_n = (128 if decode and block_d <= 64 else 64) if half and block_d <= 128 else 32
    # (4 warps spill the 128-key decode tile with the GPU image's triton 3.6.0)
    warps = 4 if block_d <= 64 and block_m * block_d < 4096 and block_n * block_d < 8192 else 8
    return dict(Q_BLOCK=q_block, QB=qb, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps)


def merge_warps(splits: int, block_d: int) -> int:
    return 4 if splits * block_d <= 4096 else 8


if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    def _grouped_attention_kernel(
        Q, K, V, O, QS, KVL, PT, BT, BL, WA, WML,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_pt,
        stride_bt, qk_scale, page_size, num_splits, window,
        HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
        Q_BLOCK: tl.constexpr, QB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, FLAT: tl.constexpr, BIDI: tl.constexpr, SPLIT: tl.constexpr,
        MIN_SPLIT: tl.constexpr, WINDOWED: tl.constexpr,
    ):
        kvh = tl.program_id(1)
        if FLAT:  # program -> (sequence, first query) from the block table
            prog = tl.program_id(0)
            s = tl.load(BT + prog).to(tl.int64)
            m_start = tl.load(BT + stride_bt + prog).to(tl.int64)
        else:
            s = tl.program_id(0).to(tl.int64)
            m_start = 0 if SPLIT else tl.program_id(2).to(tl.int64) * Q_BLOCK
        q_lo = tl.load(QS + s).to(tl.int64)
        q_len = tl.load(QS + s + 1).to(tl.int64) - q_lo
        kv_len = tl.load(KVL + s).to(tl.int64)
        q_end = tl.minimum(q_len, m_start + Q_BLOCK)  # this program's queries: [m_start, q_end)
        rows = tl.arange(0, BLOCK_M)
        head = kvh * GROUP + rows % GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        lo = 0
        if SPLIT:  # decode only: the split's keys [lo, lo + split_len)
            split_len = tl.maximum(MIN_SPLIT, (kv_len + num_splits * BLOCK_N - 1) // (num_splits * BLOCK_N) * BLOCK_N)
            lo = tl.program_id(2) * split_len
        if BIDI:
            prefix = tl.minimum(tl.load(BL + s).to(tl.int64), kv_len)
        for sub in range(0, Q_BLOCK, QB):
            q0 = m_start + sub
            # programs past their sequence's queries (padding, the grid's tail) or keys stop here
            if (q0 < q_end) & (lo < kv_len):
                start = lo
                if WINDOWED:  # the tiles wholly before the sub-block's first query's window are skipped
                    start = tl.maximum(lo, tl.maximum(kv_len - q_len + q0 - window + 1, 0) // BLOCK_N * BLOCK_N)
                q_idx = q0 + rows // GROUP
                row_ok = (rows < QB * GROUP) & (q_idx < q_end)
                q_pos = kv_len - q_len + q_idx
                tok = q_lo + q_idx
                q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                            mask=row_ok[:, None] & d_mask[None, :], other=0.0)
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.full([BLOCK_M], 0.0, tl.float32)
                acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
                # keys past the sub-block's last query position are masked for every row: skip them
                hi = tl.minimum(kv_len, kv_len - q_len + q0 + QB)
                if BIDI:  # a query inside the prefix sees the whole prefix
                    hi = tl.maximum(hi, prefix)
                if SPLIT:
                    hi = tl.minimum(hi, lo + split_len)
                for n0 in range(start, hi, BLOCK_N):
                    offs_n = n0 + tl.arange(0, BLOCK_N)
                    n_mask = offs_n < hi
                    page = tl.load(PT + s * stride_pt + offs_n // page_size, mask=n_mask, other=0).to(tl.int64)
                    kv_index = page * page_size + offs_n % page_size
                    kv_mask = n_mask[:, None] & d_mask[None, :]
                    k = tl.load(K + kv_index[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                                mask=kv_mask, other=0.0)
                    qk = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)
                    visible = offs_n[None, :] <= q_pos[:, None]
                    if BIDI:
                        visible = visible | ((q_pos[:, None] < prefix) & (offs_n[None, :] < prefix))
                    if WINDOWED:
                        visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
                    # scores in log2 units so exp2 can be used
                    qk = tl.where(visible & n_mask[None, :], qk * qk_scale, float("-inf"))
                    m_new = tl.maximum(m_i, tl.reduce(qk, 1, MAX_COMBINE))
                    m_sub = m_new
                    if WINDOWED:  # a row whose window starts past this tile (or this split) has no key yet:
                        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # 0 weights, not -inf - -inf
                    alpha = tl.math.exp2(m_i - m_sub)
                    p = tl.math.exp2(qk - m_sub[:, None])
                    l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
                    v = tl.load(V + kv_index[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                                mask=kv_mask, other=0.0)
                    pv = tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
                    acc = acc * alpha[:, None] + pv
                    m_i = m_new
                o_mask = row_ok[:, None] & d_mask[None, :]
                o_ptr = O + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
                if SPLIT:
                    if kv_len > split_len:  # a partial for _merge_splits_kernel
                        w = (s * num_splits + tl.program_id(2)) * (tl.num_programs(1) * GROUP) + head
                        tl.store(WA + w[:, None] * BLOCK_D + offs_d[None, :], acc, mask=o_mask)
                        tl.store(WML + w * 2, m_i, mask=row_ok)
                        tl.store(WML + w * 2 + 1, l_i, mask=row_ok)
                    else:
                        tl.store(o_ptr, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=o_mask)
                else:
                    tl.store(o_ptr, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=o_mask)

    def _merge_splits_kernel(
        O, QS, KVL, WA, WML, stride_ot, stride_oh, num_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
        BLOCK_S: tl.constexpr,
    ):
        """out of (sequence, head) from its split partials: sum(acc_i 2^(m_i - M)) / sum(l_i 2^(m_i - M))."""
        s = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        q_lo = tl.load(QS + s).to(tl.int64)
        q_len = tl.load(QS + s + 1).to(tl.int64) - q_lo
        kv_len = tl.load(KVL + s).to(tl.int64)
        split_len = tl.maximum(MIN_SPLIT, (kv_len + num_splits * BLOCK_N - 1) // (num_splits * BLOCK_N) * BLOCK_N)
        active = (kv_len + split_len - 1) // split_len
        if (q_len > 0) & (active > 1):  # one split wrote its output itself
            offs_s = tl.arange(0, BLOCK_S)
            s_mask = offs_s < active
            offs_d = tl.arange(0, BLOCK_D)
            w = (s * num_splits + offs_s) * tl.num_programs(1) + h
            m = tl.load(WML + w * 2, mask=s_mask, other=float("-inf"))
            scale = tl.math.exp2(m - tl.reduce(m, 0, MAX_COMBINE))  # 0 for the masked splits
            denom = tl.reduce(tl.load(WML + w * 2 + 1, mask=s_mask, other=0.0) * scale, 0, SUM_COMBINE)
            acc = tl.load(WA + w[:, None] * BLOCK_D + offs_d[None, :],
                          mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
            out = tl.reduce(acc * scale[:, None], 0, SUM_COMBINE) / denom
            tl.store(O + q_lo * stride_ot + h * stride_oh + offs_d, out.to(O.dtype.element_ty),
                     mask=offs_d < HEAD_DIM)


def _workspace(n: int, device: torch.device) -> torch.Tensor:
    """Split partials' memory; uninitialised: the merge reads only what the splits wrote (the tests
    poison it to check)."""
    return torch.empty(n, dtype=torch.float32, device=device)


_SMS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start: torch.Tensor,
                           kv_lens: torch.Tensor, page_table: torch.Tensor, page_size: int, max_q_len: int,
                           out: torch.Tensor, blocks: torch.Tensor | None = None,
                           bidirectional_lens: torch.Tensor | None = None, *, impl: str = "grouped",
                           splits: int | None = None, window: int | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """Write attention for every query token into `out` (see the module docstring) and return it.

    Only shapes, dtypes and devices are checked here (never values: this must stay graph-capturable);
    `max_q_len` must bound every q_len, and q_len <= kv_len must hold for each sequence. `blocks`:
    the [2, P] program table of `query_blocks` (then `max_q_len` is not used). `bidirectional_lens`:
    [S] int32/int64, each sequence's bidirectional prefix length (0: plain causal). `window`: sliding-window
    attention, a query at position p sees keys (p - window, p] (a host int: fixed per graph). `scale`: the
    scores' factor (None: 1/sqrt(head_dim); Gemma's query_pre_attn_scalar ** -0.5). `impl` and
    `splits` (a decode step's split count instead of `decode_splits`') are for the tests and the
    benchmark."""
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
    if impl not in IMPLS or (splits is not None and not 1 <= splits <= MAX_SPLITS):
        raise ValueError(f"impl must be one of {IMPLS} and splits in 1..{MAX_SPLITS}; got {impl!r}, {splits}")
    if window is not None and (type(window) is not int or window < 1 or impl != "grouped"):
        raise ValueError(f"window must be an int >= 1 (grouped kernel only), got {window!r} with impl {impl!r}")
    if scale is not None and impl != "grouped":
        raise ValueError(f"scale is for the grouped kernel only, got impl {impl!r}")
    if num_seqs == 0 or q.shape[0] == 0 or (max_q_len == 0 if blocks is None else blocks.shape[1] == 0):
        return out
    interpret = interpreted(q)
    # the interpreter's tl.dot multiplies bfloat16's raw uint16 bits (numpy has no bf16): upcast there,
    # which is exact; compiled code keeps bf16 operands on the tensor cores
    dot_dtype = tl.float32 if interpret and q.dtype == torch.bfloat16 else _TL_DTYPES[q.dtype]
    precision = "ieee" if q.dtype == torch.float32 else None  # exact fp32, not tf32
    bidi = kv_lens if bidirectional_lens is None else bidirectional_lens
    if impl == "per_head":
        return _launch_per_head(q, k_cache, v_cache, query_start, kv_lens, page_table, page_size, max_q_len, out,
                                blocks, bidi, bidirectional_lens is not None, dot_dtype, precision, interpret)
    group = heads // kv_heads
    decode = blocks is None and max_q_len == 1
    t = tiles(group, head_dim, q.dtype, decode)
    if decode:
        n_split = splits or decode_splits(num_seqs, kv_heads, page_table.shape[1] * page_size, _sm_count(q.device))
        grid = (num_seqs, kv_heads, n_split)
    else:
        n_split = 1
        grid = (num_seqs, kv_heads, cdiv(max_q_len, QUERY_BLOCK)) if blocks is None else (blocks.shape[1],
                                                                                                  kv_heads, 1)
    if n_split > 1:  # fp32 partials: accumulator [S, splits, heads, BLOCK_D], (max, sum) [.., 2]
        work_acc = _workspace(num_seqs * n_split * heads * t["BLOCK_D"], q.device)
        work_ml = _workspace(num_seqs * n_split * heads * 2, q.device)
    else:
        work_acc = work_ml = out  # never touched
    jitted(_grouped_attention_kernel, interpret)[grid](
        q, k_cache, v_cache, out, query_start, kv_lens, page_table, page_table if blocks is None else blocks, bidi,
        work_acc, work_ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), 0 if blocks is None else blocks.stride(0),
        _LOG2E * (1 / math.sqrt(head_dim) if scale is None else scale), page_size, n_split, window or 0,
        HEAD_DIM=head_dim, GROUP=group, DOT_DTYPE=dot_dtype, PRECISION=precision, FLAT=blocks is not None,
        BIDI=bidirectional_lens is not None, SPLIT=n_split > 1, MIN_SPLIT=MIN_SPLIT, WINDOWED=window is not None,
        **t,
    )
    if n_split > 1:
        jitted(_merge_splits_kernel, interpret)[(num_seqs, heads)](
            out, query_start, kv_lens, work_acc, work_ml, out.stride(0), out.stride(1), n_split,
            HEAD_DIM=head_dim, BLOCK_D=t["BLOCK_D"], BLOCK_N=t["BLOCK_N"], MIN_SPLIT=MIN_SPLIT,
            BLOCK_S=next_power_of_2(n_split), num_warps=merge_warps(n_split, t["BLOCK_D"]),
        )
    return out


def _launch_per_head(q, k_cache, v_cache, query_start, kv_lens, page_table, page_size, max_q_len, out, blocks,
                     bidi, has_bidi, dot_dtype, precision, interpret):
    """The kernel before GQA grouping (attention_per_head_triton.py), with its launch configuration."""
    num_seqs, heads, head_dim = kv_lens.shape[0], q.shape[1], q.shape[2]
    block_d = max(16, next_power_of_2(head_dim))
    block_n = 64 if q.dtype != torch.float32 and block_d <= 128 else 32
    grid = ((num_seqs, heads, cdiv(max_q_len, QUERY_BLOCK)) if blocks is None
            else (blocks.shape[1], heads, 1))
    jitted(per_head.paged_attention_kernel, interpret)[grid](
        q, k_cache, v_cache, out, query_start, kv_lens, page_table, page_table if blocks is None else blocks, bidi,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1), page_table.stride(0), 0 if blocks is None else blocks.stride(0),
        _LOG2E / math.sqrt(head_dim), page_size,
        HEAD_DIM=head_dim, GROUP=heads // k_cache.shape[1], DOT_DTYPE=dot_dtype, PRECISION=precision,
        BLOCK_M=QUERY_BLOCK, BLOCK_N=block_n, BLOCK_D=block_d, FLAT=blocks is not None, BIDI=has_bidi,
        num_warps=4 if block_d <= 64 else 8,
    )
    return out

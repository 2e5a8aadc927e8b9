"""The per-head paged-attention kernel: attention_triton.py's kernel before issue 42, kept as the
baseline the benchmark (tools/gpu/bench_attention_cuda.py) and the tests compare the grouped kernel with
(`paged_attention_triton(..., impl="per_head")`). Nothing on the serving path launches it.

One program per (sequence, query head, BLOCK_M queries): with GQA every K/V tile is read by each of
the GROUP heads that share it, and a decode query fills one row of its BLOCK_M-row tile.
"""
from slipstream.models.kernels.triton_jit import MAX_COMBINE, SUM_COMBINE, tl, triton

if triton is not None:
    def paged_attention_kernel(
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

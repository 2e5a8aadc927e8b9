"""A decode layer in five Triton launches: RMSNorm in the GEMVs' prologue, the residual add in their epilogue.

For a step of a few token rows (decode: one per sequence) every matmul of a small model is a GEMV
that streams its weight once, and the step is bound by launch latency, not bytes (issue 42: 255
kernels, 1.09 ms of graph replay against a 0.1 ms floor for SmolLM2-135M at batch 1). The
8-launch layer of llama/forward_triton.py becomes

    norm + QKV + rotary + KV write   `norm_qkv_rotary_triton`
    paged attention                  (attention_triton.py, unchanged)
    o_proj + residual add            `linear_residual_triton`
    norm + gate-up + SiLU·up         `norm_gate_up_silu_triton`
    down + residual add              `linear_residual_triton`

No atomics and no split over the reduction dim: each program owns disjoint output columns, so
results are deterministic. The norm's sum of squares is recomputed by every program that needs a
row (hidden sizes are small: SmolLM2's row is 1.1 KB), instead of a launch to compute it once. The
residual stream `x` is then always complete between launches: the sublayer outputs are added in
place by the projection that makes them (each program its own columns of `x`, read then written).

The QKV program owns one head's columns j..j+BLOCK_H of the first half of the head and the same
columns of the second half, the pairs rotary mixes, in two accumulators; the rotation is then
elementwise. Two paths, chosen on the host by the step's rows: up to GEMV_MAX_ROWS the GEMV path
(constexpr GEMV) holds all rows in one tile of next_power_of_2(rows), 4–8 weight columns a program
and sums elementwise products over K (SmolLM2: 120–192 programs a GEMV, where 16-column tl.dot
tiles gave 30–36 and left most of an H100's SMs idle); above it tl.dot tiles of 16 rows and
columns (masked when the half head is narrower).

Rounding follows the reference path at each step it rounds: the normed row and its product with
the norm weight, each projection's output (plus bias), rotary's cos/sin and result, SiLU and the
product, and the residual sum. Only summation orders differ. Graph-capturable: no host reads of
device values; the wrappers allocate only their outputs (torch.empty).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.models.kernels.add_norm_triton import add_rms_norm_reference
from slipstream.models.kernels.gate_up_silu_triton import gate_up_silu_reference
from slipstream.models.kernels.rotary_kv_triton import rotary_kv_reference
from slipstream.models.kernels.triton_jit import (SUM_COMBINE, cdiv, interpreted, jitted, next_power_of_2, require_triton,
                                                 tl, triton)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    def _norm_qkv_rotary_kernel(
        X, NW, W, B, Q, KC, VC, POS, KV_INDICES, COS, SIN, M, K, eps,
        stride_xm, stride_wn, stride_qt, stride_qh, stride_kct, stride_kch, stride_vct, stride_vch, stride_c,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
        HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, GEMV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        rows = offs_m.to(tl.int64)
        h = tl.program_id(1)
        offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)  # columns within each half of the head
        h_mask = offs_h < HALF
        col1 = (h * HEAD_DIM + offs_h).to(tl.int64)  # rows of the fused weight
        col2 = col1 + HALF
        act = X.dtype.element_ty
        ss = tl.full([BLOCK_M], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :],
                         other=0.0).to(tl.float32)
            ss += tl.reduce(xs * xs, 1, SUM_COMBINE)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc1 = tl.full([BLOCK_M, BLOCK_H], 0.0, tl.float32)
        acc2 = tl.full([BLOCK_M, BLOCK_H], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)
            nw = tl.load(NW + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            hn = ((x * rstd[:, None]).to(act).to(tl.float32) * nw[None, :]).to(act)
            if GEMV:  # [BLOCK_H, BLOCK_K] tiles, each column's weights contiguous; products summed over K
                w_mask = h_mask[:, None] & k_mask[None, :]
                w1 = tl.load(W + col1[:, None] * stride_wn + offs_k[None, :], mask=w_mask, other=0.0)
                w2 = tl.load(W + col2[:, None] * stride_wn + offs_k[None, :], mask=w_mask, other=0.0)
                hf = hn.to(tl.float32)[:, None, :]
                acc1 += tl.reduce(hf * w1.to(tl.float32)[None, :, :], 2, SUM_COMBINE)
                acc2 += tl.reduce(hf * w2.to(tl.float32)[None, :, :], 2, SUM_COMBINE)
            else:
                hn = hn.to(DOT_DTYPE)
                w_mask = k_mask[:, None] & h_mask[None, :]
                w1 = tl.load(W + col1[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)  # [K, H]
                w2 = tl.load(W + col2[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
                acc1 += tl.dot(hn, w1.to(DOT_DTYPE), input_precision=PRECISION)
                acc2 += tl.dot(hn, w2.to(DOT_DTYPE), input_precision=PRECISION)
        if HAS_BIAS:
            acc1 += tl.load(B + col1, mask=h_mask, other=0.0).to(tl.float32)[None, :]
            acc2 += tl.load(B + col2, mask=h_mask, other=0.0).to(tl.float32)[None, :]
        y1 = acc1.to(act).to(tl.float32)  # the projection's output, rounded as the reference's matmul
        y2 = acc2.to(act).to(tl.float32)
        mask = m_mask[:, None] & h_mask[None, :]
        if h < HEADS + KV_HEADS:  # a query or key head: rotate it
            pos = tl.load(POS + rows, mask=m_mask, other=0).to(tl.int64)
            cos = tl.load(COS + pos[:, None] * stride_c + offs_h[None, :], mask=mask, other=0.0).to(act).to(tl.float32)
            sin = tl.load(SIN + pos[:, None] * stride_c + offs_h[None, :], mask=mask, other=0.0).to(act).to(tl.float32)
            r1 = (y1 * cos - y2 * sin).to(act)
            r2 = (y2 * cos + y1 * sin).to(act)
            if h < HEADS:
                dst = Q + rows[:, None] * stride_qt + h * stride_qh + offs_h[None, :]
            else:
                slot = tl.load(KV_INDICES + rows, mask=m_mask, other=0).to(tl.int64)
                dst = KC + slot[:, None] * stride_kct + (h - HEADS) * stride_kch + offs_h[None, :]
            tl.store(dst, r1, mask=mask)
            tl.store(dst + HALF, r2, mask=mask)
        else:  # a value head: into the cache as it is
            slot = tl.load(KV_INDICES + rows, mask=m_mask, other=0).to(tl.int64)
            dst = VC + slot[:, None] * stride_vct + (h - HEADS - KV_HEADS) * stride_vch + offs_h[None, :]
            tl.store(dst, y1.to(act), mask=mask)
            tl.store(dst + HALF, y2.to(act), mask=mask)

    def _decode_linear_kernel(
        X, NW, W, Y, M, N, K, eps, stride_xm, stride_wn, stride_ym,
        NORM: tl.constexpr, GATE_UP: tl.constexpr, RESIDUAL: tl.constexpr,
        DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, GEMV: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """Y[:, cols] = X @ W[cols].T, with NORM: X RMS-normed (weight NW) on the way in; GATE_UP:
        silu(X @ W[cols].T) * (X @ W[N + cols].T); RESIDUAL: Y[:, cols] += instead of =."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        rows = offs_m.to(tl.int64)
        cols = offs_n.to(tl.int64)
        act = X.dtype.element_ty
        if NORM:
            ss = tl.full([BLOCK_M], 0.0, tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                xs = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :],
                             mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
                ss += tl.reduce(xs * xs, 1, SUM_COMBINE)
            rstd = 1.0 / tl.sqrt(ss / K + eps)
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        if GATE_UP:
            acc_u = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            if NORM:
                nw = tl.load(NW + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                x = ((x.to(tl.float32) * rstd[:, None]).to(act).to(tl.float32) * nw[None, :]).to(act)
            if GEMV:  # [BLOCK_N, BLOCK_K] tiles, each column's weights contiguous; products summed over K
                xf = x.to(tl.float32)[:, None, :]
                w_mask = n_mask[:, None] & k_mask[None, :]
                w = tl.load(W + cols[:, None] * stride_wn + offs_k[None, :], mask=w_mask, other=0.0)
                acc += tl.reduce(xf * w.to(tl.float32)[None, :, :], 2, SUM_COMBINE)
                if GATE_UP:
                    wu = tl.load(W + (cols[:, None] + N) * stride_wn + offs_k[None, :], mask=w_mask, other=0.0)
                    acc_u += tl.reduce(xf * wu.to(tl.float32)[None, :, :], 2, SUM_COMBINE)
            else:
                x = x.to(DOT_DTYPE)
                w_mask = k_mask[:, None] & n_mask[None, :]
                w = tl.load(W + cols[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)  # [K, N]
                acc += tl.dot(x, w.to(DOT_DTYPE), input_precision=PRECISION)
                if GATE_UP:
                    wu = tl.load(W + (cols[None, :] + N) * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
                    acc_u += tl.dot(x, wu.to(DOT_DTYPE), input_precision=PRECISION)
        out_ty = Y.dtype.element_ty
        y = acc.to(out_ty)
        if GATE_UP:
            g = y.to(tl.float32)
            u = acc_u.to(out_ty).to(tl.float32)
            silu = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
            y = (silu * u).to(out_ty)
        mask = m_mask[:, None] & n_mask[None, :]
        ptrs = Y + rows[:, None] * stride_ym + offs_n[None, :]
        if RESIDUAL:  # this program's columns of the residual stream: read, add, write back
            y = (tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + y.to(tl.float32)).to(out_ty)
        tl.store(ptrs, y, mask=mask)


BLOCK_M = 16  # tl.dot's smallest tile; fused_decode_max_rows above it adds row blocks (weights re-read)
GEMV_MAX_ROWS = 16  # up to here the kernels skip tl.dot: one row tile of next_power_of_2(rows), narrow columns
_GEMV_BUDGET = 8192  # fp32 products a program holds per K chunk (4 warps: 64 registers a thread)


def _dot_args(x: torch.Tensor, interpret: bool) -> dict:
    # numpy has no bf16: the interpreter's dot would multiply raw bits, so upcast there (exact)
    dot = tl.float32 if interpret and x.dtype == torch.bfloat16 else _TL_DTYPES[x.dtype]
    return dict(DOT_DTYPE=dot, PRECISION="ieee" if x.dtype == torch.float32 else None)


def _gemv_tiles(rows: int, k: int, columns: int) -> dict:
    """A step of at most GEMV_MAX_ROWS rows: all rows in one tile, the longest K chunk the budget
    allows for `columns` weight columns in flight (the first launch at 1 row: 1–2 chunks)."""
    block_m = next_power_of_2(rows)
    block_k = max(16, min(next_power_of_2(k), _GEMV_BUDGET // (block_m * columns)))
    return dict(GEMV=True, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4, num_stages=3)


def qkv_launch(hidden: int, dtype: torch.dtype, rows: int) -> dict:
    """Tiles and warps of the QKV kernel for a step of `rows` rows. Up to GEMV_MAX_ROWS: 4-column
    slices of each half head (SmolLM2: 15 heads x 8 = 120 programs); above: tl.dot on 16-column
    slices (30 programs a row tile). Pending GPU timings (NOTES.md of kernels-2026-11-27)."""
    if rows <= GEMV_MAX_ROWS:
        return dict(BLOCK_H=4, **_gemv_tiles(rows, hidden, 2 * 4))
    block_k = max(16, min(64 if dtype == torch.float32 else 128, next_power_of_2(hidden)))
    return dict(GEMV=False, BLOCK_M=BLOCK_M, BLOCK_H=16, BLOCK_K=block_k, num_warps=4, num_stages=3)


def linear_launch(k: int, n: int, dtype: torch.dtype, gate_up: bool, rows: int) -> dict:
    """Tiles and warps of the GEMV kernel over a reduction dim of k, n output columns, `rows` rows.
    Up to GEMV_MAX_ROWS: 8 columns a program where that still makes 128 programs, else 4 (SmolLM2:
    144 for o_proj and down, 192 for gate-up); above: tl.dot on 16-column tiles (36 and 96)."""
    if rows <= GEMV_MAX_ROWS:
        block_n = 8 if cdiv(n, 8) >= 128 else 4
        return dict(BLOCK_N=block_n, **_gemv_tiles(rows, k, block_n * (2 if gate_up else 1)))
    block_k = max(16, min(64 if dtype == torch.float32 or gate_up else 128, next_power_of_2(k)))
    return dict(GEMV=False, BLOCK_M=BLOCK_M, BLOCK_N=16, BLOCK_K=block_k, num_warps=4, num_stages=3)


def _check(x: torch.Tensor, what: str, *others: torch.Tensor) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{what} must be [T, n] with a contiguous last dim; got {tuple(x.shape)}")
    if x.dtype not in _DTYPES or any(o.dtype != x.dtype or o.device != x.device for o in others):
        raise TypeError(f"{what} and the weights must share one dtype of {_DTYPES} and a device; got "
                        f"{[str(t.dtype) for t in (x, *others)]}")
    if any(o.stride(-1) != 1 for o in others):
        raise ValueError("weights need a contiguous last dim")


def norm_qkv_rotary_reference(x, norm_weight, eps, qkv_weight, qkv_bias, heads, kv_heads, positions, cos, sin,
                              k_cache, v_cache, kv_indices) -> torch.Tensor:
    """What `norm_qkv_rotary_triton` computes, with the reference path's ops."""
    t, d = x.shape[0], qkv_weight.shape[0] // (heads + 2 * kv_heads)
    qkv = F.linear(add_rms_norm_reference(None, x, norm_weight, eps), qkv_weight, qkv_bias)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q = q.reshape(t, heads, d)
    rotary_kv_reference(q, k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d), positions, cos, sin, k_cache,
                        v_cache, kv_indices)
    return q


def norm_qkv_rotary_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv_weight: torch.Tensor,
                           qkv_bias: torch.Tensor | None, heads: int, kv_heads: int, positions: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_indices: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D] (rotated) of the RMS-normed rows of x [T, hidden] times the fused QKV weight
    [(H + 2 KVH) D, hidden] (+ bias); k rotated and v are written to the caches [N, KVH, D] at
    kv_indices [T] and nowhere else. `out`: where q goes (a new tensor if None)."""
    require_triton("norm_qkv_rotary_triton")
    _check(x, "x", norm_weight, qkv_weight, k_cache, v_cache, *(() if qkv_bias is None else (qkv_bias,)))
    t, hidden = x.shape
    width = heads + 2 * kv_heads
    d = qkv_weight.shape[0] // width if width > 0 else 0
    if (heads <= 0 or kv_heads <= 0 or d % 2 or d == 0 or qkv_weight.shape != (width * d, hidden)
            or norm_weight.shape != (hidden,) or (qkv_bias is not None and qkv_bias.shape != (width * d,))
            or k_cache.dim() != 3 or k_cache.shape[1:] != (kv_heads, d) or v_cache.shape != k_cache.shape
            or positions.shape != (t,) or kv_indices.shape != (t,) or cos.shape != sin.shape or cos.dim() != 2
            or cos.shape[1] != d or cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        raise ValueError(f"expected x [T, hidden], norm weight [hidden], qkv weight [(H + 2 KVH) D, hidden] with D "
                         f"even, caches [N, KVH, D], positions/kv_indices [T], cos/sin [P, D] (one layout); got x "
                         f"{tuple(x.shape)}, qkv {tuple(qkv_weight.shape)} for H={heads} KVH={kv_heads}, cache "
                         f"{tuple(k_cache.shape)}, positions {tuple(positions.shape)}, kv_indices "
                         f"{tuple(kv_indices.shape)}, cos {tuple(cos.shape)}")
    if t > 1 and (positions.stride(0) != 1 or kv_indices.stride(0) != 1):
        raise ValueError("positions and kv_indices must be contiguous")
    if any(o.device != x.device for o in (positions, kv_indices, cos, sin)):
        raise ValueError("all tensors must be on x's device")
    if out is None:
        out = torch.empty(t, heads, d, dtype=x.dtype, device=x.device)
    elif out.shape != (t, heads, d) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, H, D] of x's dtype, contiguous last dim; got {tuple(out.shape)}")
    if t:
        interpret = interpreted(x)
        cfg = qkv_launch(hidden, x.dtype, t)
        grid = (cdiv(t, cfg["BLOCK_M"]), width, cdiv(d // 2, cfg["BLOCK_H"]))
        jitted(_norm_qkv_rotary_kernel, interpret)[grid](
            x, norm_weight, qkv_weight, qkv_weight if qkv_bias is None else qkv_bias, out, k_cache, v_cache,
            positions, kv_indices, cos, sin, t, hidden, eps,
            x.stride(0), qkv_weight.stride(0), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), cos.stride(0),
            HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=d, HALF=d // 2, HAS_BIAS=qkv_bias is not None,
            **_dot_args(x, interpret), **cfg)
    return out


def linear_residual_reference(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> None:
    residual.copy_(residual + F.linear(x, weight))


def linear_residual_triton(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> None:
    """residual += x @ weight.T in place, for x [T, K], weight [N, K], residual [T, N]."""
    require_triton("linear_residual_triton")
    _check(x, "x", weight, residual)
    t, k = x.shape
    if weight.shape[1:] != (k,) or residual.shape != (t, weight.shape[0]):
        raise ValueError(f"expected x [T, K], weight [N, K], residual [T, N]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(residual.shape)}")
    n = weight.shape[0]
    if t and n:
        interpret = interpreted(x)
        cfg = linear_launch(k, n, x.dtype, gate_up=False, rows=t)
        jitted(_decode_linear_kernel, interpret)[(cdiv(t, cfg["BLOCK_M"]), cdiv(n, cfg["BLOCK_N"]))](
            x, weight, weight, residual, t, n, k, 0.0, x.stride(0), weight.stride(0), residual.stride(0),
            NORM=False, GATE_UP=False, RESIDUAL=True, **_dot_args(x, interpret), **cfg)


def norm_gate_up_silu_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                gate_up_weight: torch.Tensor) -> torch.Tensor:
    return gate_up_silu_reference(add_rms_norm_reference(None, x, norm_weight, eps), gate_up_weight)


def norm_gate_up_silu_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(h @ W[:I].T) * (h @ W[I:].T) for h = RMSNorm(x) (weight norm_weight), x [T, hidden] and
    the fused gate-up W [2I, hidden]: [T, I], in `out` or a new tensor."""
    require_triton("norm_gate_up_silu_triton")
    _check(x, "x", norm_weight, gate_up_weight)
    t, k = x.shape
    if norm_weight.shape != (k,) or gate_up_weight.shape[1:] != (k,) or gate_up_weight.shape[0] % 2:
        raise ValueError(f"expected x [T, hidden], norm weight [hidden], gate-up weight [2I, hidden]; got "
                         f"{tuple(x.shape)}, {tuple(norm_weight.shape)}, {tuple(gate_up_weight.shape)}")
    n = gate_up_weight.shape[0] // 2
    if out is None:
        out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    elif out.shape != (t, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, I] of x's dtype, contiguous last dim; got {tuple(out.shape)}")
    if t and n:
        interpret = interpreted(x)
        cfg = linear_launch(k, n, x.dtype, gate_up=True, rows=t)
        jitted(_decode_linear_kernel, interpret)[(cdiv(t, cfg["BLOCK_M"]), cdiv(n, cfg["BLOCK_N"]))](
            x, norm_weight, gate_up_weight, out, t, n, k, eps, x.stride(0), gate_up_weight.stride(0), out.stride(0),
            NORM=True, GATE_UP=True, RESIDUAL=False, **_dot_args(x, interpret), **cfg)
    return out

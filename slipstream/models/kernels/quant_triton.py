"""Quantized matmul on CUDA: the weights expanded inside the GEMM's K loop (Triton), never in memory.

y [M, N] = x [M, K] @ W^T for W a QuantWeight (quant_formats.py), in its panel layout: a program owns
BLOCK_N output columns (whole panels of 16 rows of W) and BLOCK_M rows of x, and walks K one group at
a time, loading the group's packed values for its columns, expanding them with the group's scales and
offsets to x's dtype, and accumulating tl.dot products in float32.

    u4  a group is 32 columns of K: 16 bytes per row hold columns j (low nibble) and j + 16 (high),
        so the group is two [16, BLOCK_N] halves, each one tl.dot with its 16 columns of x
    i8  a group is 16 or 32 columns: one [group, BLOCK_N] tile

The expanded weight is rounded to x's dtype before the dot, as a dequantized model of that dtype holds
it (float32 runs in IEEE mode, not TF32), so results match dequantize-then-matmul up to the order of
summation (tests/test_quant_triton.py, under TRITON_INTERPRET=1). Graph-capturable: no host reads of
device values; allocates only its output. Embedding rows (QuantEmbedding) are expanded with torch ops
(a few rows per step). Timings are pending a GPU (docs/benchmarks.md, "Quantized weights").
"""
from __future__ import annotations

import torch

from slipstream.models.kernels.quant_formats import PANEL, QuantWeight
from slipstream.models.kernels.triton_jit import interpreted, jitted, cdiv, require_triton, tl, triton

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    def _quant_matmul_kernel(X, V, S, O, Y, M, N, K, stride_xm, stride_ym,
                             KIND: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr,
                             DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        rows = offs_m.to(tl.int64)
        panel = (offs_n // 16).to(tl.int64)
        lane = (offs_n % 16).to(tl.int64)
        groups = K // GROUP
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for g in range(0, groups):
            sidx = (panel * groups + g) * 16 + lane  # [BLOCK_N]
            s = tl.load(S + sidx, mask=n_mask, other=0.0).to(tl.float32)
            if HAS_OFFSET:
                o = tl.load(O + sidx, mask=n_mask, other=0.0).to(tl.float32)
            else:
                o = tl.full([BLOCK_N], 0.0, tl.float32)
            if KIND == 0:
                j = tl.arange(0, 16)
                b = tl.load(V + (panel[None, :] * groups + g) * 256 + j[:, None] * 16 + lane[None, :],
                            mask=n_mask[None, :], other=0).to(tl.int32)  # [16, BLOCK_N] bytes
                w_lo = ((b & 15).to(tl.float32) * s[None, :] + o[None, :]).to(DOT_DTYPE)
                w_hi = ((b >> 4).to(tl.float32) * s[None, :] + o[None, :]).to(DOT_DTYPE)
                k_lo = g * 32 + j
                x_lo = tl.load(X + rows[:, None] * stride_xm + k_lo[None, :], mask=m_mask[:, None], other=0.0)
                x_hi = tl.load(X + rows[:, None] * stride_xm + (k_lo + 16)[None, :], mask=m_mask[:, None],
                               other=0.0)
                acc += tl.dot(x_lo.to(DOT_DTYPE), w_lo, input_precision=PRECISION)
                acc += tl.dot(x_hi.to(DOT_DTYPE), w_hi, input_precision=PRECISION)
            else:
                c = tl.arange(0, GROUP)
                k = g * GROUP + c
                q = tl.load(V + panel[None, :] * (K * 16) + k[:, None] * 16 + lane[None, :], mask=n_mask[None, :],
                            other=0).to(tl.float32)  # [GROUP, BLOCK_N]
                w = (q * s[None, :] + o[None, :]).to(DOT_DTYPE)
                xk = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=m_mask[:, None], other=0.0)
                acc += tl.dot(xk.to(DOT_DTYPE), w, input_precision=PRECISION)
        out_ty = Y.dtype.element_ty
        tl.store(Y + rows[:, None] * stride_ym + offs_n[None, :], acc.to(out_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def launch_config(rows: int) -> dict:
    """A program per 16 x rows and 2 panels of columns at decode (a weight-streaming problem: many
    programs share the reads), larger tiles for prefill. A guess pending a GPU."""
    if rows <= 16:
        return dict(BLOCK_M=16, BLOCK_N=2 * PANEL, num_warps=4, num_stages=3)
    if rows <= 64:
        return dict(BLOCK_M=32, BLOCK_N=4 * PANEL, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=4 * PANEL, num_warps=8, num_stages=2)


def quant_matmul_triton(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype (float32, bfloat16 or float16), on x's device."""
    require_triton("quant_matmul_triton")
    if x.dim() != 2 or x.shape[1] != w.cols or x.stride(-1) != 1:
        raise ValueError(f"expected x [M, {w.cols}] with a contiguous last dim, got {tuple(x.shape)}")
    if x.dtype not in _DTYPES or w.device != x.device:
        raise TypeError(f"x must be one of {_DTYPES} on the weight's device ({w.device}); got {x.dtype} on {x.device}")
    m, k = x.shape
    n = w.rows
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        interpret = interpreted(x)
        kernel = jitted(_quant_matmul_kernel, interpret)
        # numpy has no bf16: the interpreter's dot would multiply raw bits, so upcast there (exact)
        dot_dtype = tl.float32 if interpret and x.dtype == torch.bfloat16 else _TL_DTYPES[x.dtype]
        cfg = launch_config(m)
        kernel[(cdiv(m, cfg["BLOCK_M"]), cdiv(n, cfg["BLOCK_N"]))](
            x, w.values, w.scales, w.scales if w.offsets is None else w.offsets, out, m, n, k, x.stride(0),
            out.stride(0), KIND=0 if w.kind == "u4" else 1, GROUP=w.group, HAS_OFFSET=w.offsets is not None,
            DOT_DTYPE=dot_dtype, PRECISION="ieee" if x.dtype == torch.float32 else None, **cfg)
    return out


def quant_rows_triton(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of W as float32 (an embedding lookup), with torch gathers on W's device (graph-capturable)."""
    return w.take(ids)

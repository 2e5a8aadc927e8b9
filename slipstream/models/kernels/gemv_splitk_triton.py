"""y = x @ W.T for a few token rows (decode at batch <= 16): a Triton GEMV, split over K when N is too narrow.

cuBLAS runs a small-M GEMM as a tiled GEMM: on an H200 ~3.9 µs for SmolLM2's matrices, which take
~0.2 µs to read (issue 50). Here every row of the step is in one tile of next_power_of_2(rows), a
program owns BLOCK_N weight columns and sums elementwise products over K in fp32 (no tl.dot: with
rows <= 16 a tensor-core tile would be mostly padding). With `split` > 1 the K range is cut into
`split` slices, one program each, whose fp32 partials land in a workspace [split, T, N] and a second
launch sums them in a fixed order (deterministic, no atomics) and rounds once to the output dtype:
more programs for a narrow N (o_proj, down: N = hidden) at the cost of one launch. Which of these
(or cuBLAS) a shape takes is measured, not assumed: models/kernels/gemm_choice.py.

Rounding: one rounding of the fp32 sum to the output dtype, as cuBLAS's; only the summation order
differs. Graph-capturable: no host reads of device values; the wrapper allocates its output and
workspace with torch.empty.
"""
from __future__ import annotations

import torch

from slipstream.models.kernels.triton_jit import (SUM_COMBINE, cdiv, interpreted, jitted, next_power_of_2,
                                                  require_triton, tl, triton)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_ROWS = 16  # one row tile of next_power_of_2(rows): past this, tl.dot tiles (cuBLAS) are the better shape
_BUDGET = 8192  # fp32 products a program holds per K chunk (4 warps: 64 registers a thread)
REDUCE_BLOCK = 1024

if triton is not None:

    def _gemv_splitk_kernel(X, W, Y, P, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                            PARTIAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
        """Columns program_id(0) of Y, or with PARTIAL of the fp32 partial sums P[program_id(1)] over
        the K slice [program_id(1) * k_per_split, + k_per_split) (k_per_split: a multiple of BLOCK_K)."""
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        rows = offs_m.to(tl.int64)
        cols = offs_n.to(tl.int64)
        k_start = tl.program_id(1) * k_per_split
        acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, k_per_split, BLOCK_K):
            offs_k = k_start + k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)
            w = tl.load(W + cols[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.reduce(x[:, None, :] * w[None, :, :], 2, SUM_COMBINE)
        mask = m_mask[:, None] & n_mask[None, :]
        if not PARTIAL:
            tl.store(Y + rows[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)
        else:
            base = tl.program_id(1).to(tl.int64) * M * N
            tl.store(P + base + rows[:, None] * N + offs_n[None, :], acc, mask=mask)

    def _splitk_reduce_kernel(P, Y, M, N, stride_ym, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        """Y[m, n] = sum over s of P[s, m, n], in order s = 0, 1, ..., rounded once."""
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        total = M * N
        mask = idx < total
        acc = tl.full([BLOCK], 0.0, tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(P + s * total + idx, mask=mask, other=0.0)
        m = idx // N
        n = idx % N
        tl.store(Y + m * stride_ym + n, acc.to(Y.dtype.element_ty), mask=mask)


def gemv_launch(rows: int, k: int, block_n: int, split: int) -> dict:
    """Tiles of a step of `rows` rows over a reduction dim of k: all rows in one tile, the longest K
    chunk the budget allows for block_n columns and no longer than a slice; each of the `split` K slices
    a whole number of chunks."""
    block_m = next_power_of_2(rows)
    block_k = max(16, min(next_power_of_2(cdiv(k, split)), _BUDGET // (block_m * block_n)))
    k_per_split = cdiv(cdiv(k, split), block_k) * block_k
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, k_per_split=k_per_split, num_warps=4,
                num_stages=3)


def gemv_splitk_triton(x: torch.Tensor, weight: torch.Tensor, block_n: int = 8, split: int = 1,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K].T for T <= MAX_ROWS: [T, N] in x's dtype, in `out` or a new tensor."""
    require_triton("gemv_splitk_triton")
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"expected x [T, K] and weight [N, K]; got {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or weight.device != x.device:
        raise TypeError(f"x and weight must share one dtype of {_DTYPES} and a device; got {x.dtype}, {weight.dtype}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    t, k = x.shape
    n = weight.shape[0]
    if t > MAX_ROWS:
        raise ValueError(f"gemv_splitk_triton takes at most {MAX_ROWS} rows, got {t}")
    if block_n < 1 or block_n & (block_n - 1) or split < 1:
        raise ValueError(f"block_n must be a power of two and split >= 1; got {block_n}, {split}")
    if out is None:
        out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    elif out.shape != (t, n) or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, N] of x's dtype with a contiguous last dim; got {tuple(out.shape)}")
    if t == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    interpret = interpreted(x)
    cfg = gemv_launch(t, k, block_n, split)
    k_per_split = cfg.pop("k_per_split")
    split = cdiv(k, k_per_split)  # (whole chunks per slice: fewer slices than asked when K is short)
    partial = out if split == 1 else torch.empty(split, t, n, dtype=torch.float32, device=x.device)
    jitted(_gemv_splitk_kernel, interpret)[(cdiv(n, block_n), split)](
        x, weight, out, partial, t, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
        PARTIAL=split > 1, **cfg)
    if split > 1:
        jitted(_splitk_reduce_kernel, interpret)[(cdiv(t * n, REDUCE_BLOCK),)](
            partial, out, t, n, out.stride(0), SPLIT=split, BLOCK=REDUCE_BLOCK, num_warps=4)
    return out

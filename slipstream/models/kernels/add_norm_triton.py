"""Residual add folded into RMSNorm: one Triton kernel where the reference runs an add and a norm.

A decoder layer adds each sublayer's output to the residual stream and normalises the sum for the
next sublayer: `residual = residual + x; h = norm(residual)`. Run as two kernels that is an extra
launch (and an extra pass over the activations) twice per layer; a decode step of a small model is
bound by launches, not bytes. Here one program per row loads both rows, adds them, writes the sum
back into `residual` (in place) and the normalised row into a fresh output.

Rounding follows the reference path (llama/model.py: `x = x + sublayer(...)`, then `RMSNorm.forward`):
the sum is rounded to the activation dtype before it is stored and normalised, the normalised row
is rounded before the weight multiply, and the product is rounded once. Only the order of the
sum of squares differs.

`rows` gathers: the final norm needs only the rows that sample, so it reads those rows of both
inputs and writes [len(rows), hidden] without touching `residual` (nothing reads it afterwards),
replacing the reference's index_select + norm. Graph-capturable: reads no device value on the
host, allocates only its output.
"""
from __future__ import annotations

import torch

from slipstream.models.kernels.triton_jit import (SUM_COMBINE, interpreted, jitted, next_power_of_2,
                                                 require_triton, tl, triton)

if triton is not None:
    def _add_rms_norm_kernel(X, R, W, Y, ROWS, stride_x, stride_r, stride_y, n_cols, eps,
                             HAS_X: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        if HAS_ROWS:
            row = tl.load(ROWS + i).to(tl.int64)
        else:
            row = i
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        if HAS_X:
            x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
            r = (r.to(tl.float32) + x.to(tl.float32)).to(R.dtype.element_ty)  # the reference's rounded sum
            if not HAS_ROWS:
                tl.store(R + row * stride_r + offs, r, mask=mask)
        r = r.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.reduce(r * r, 0, SUM_COMBINE) / n_cols + eps)
        normed = (r * rstd).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + i * stride_y + offs, (w * normed).to(Y.dtype.element_ty), mask=mask)


def add_rms_norm_reference(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
    """What `add_rms_norm_triton` computes, with the reference path's PyTorch ops (in place on
    `residual` exactly when the kernel is)."""
    if rows is not None:
        residual = residual.index_select(0, rows)
        x = None if x is None else x.index_select(0, rows)
    if x is not None:
        summed = residual + x
        if rows is None:
            residual.copy_(summed)
        residual = summed
    dtype = residual.dtype
    r = residual.float()
    r = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)
    return weight * r.to(dtype)


def add_rms_norm_triton(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        rows: torch.Tensor | None = None) -> torch.Tensor:
    """norm(residual + x) over the last dim of [T, hidden] activations, with `residual += x` in place
    (x None: norm(residual), nothing written). With `rows` [N] (indices into T): the normalised
    sums of those rows only, [N, hidden], and `residual` is left as it was."""
    require_triton("add_rms_norm_triton")
    if (residual.dim() != 2 or weight.shape != residual.shape[-1:] or residual.stride(-1) != 1
            or weight.device != residual.device):
        raise ValueError(f"expected residual [T, hidden] with a contiguous last dim and weight [hidden] on its "
                         f"device; got residual {tuple(residual.shape)}, weight {tuple(weight.shape)}")
    if x is not None and (x.shape != residual.shape or x.stride(-1) != 1 or x.dtype != residual.dtype
                          or x.device != residual.device):
        raise ValueError(f"x must match residual (shape, dtype, device, contiguous last dim); got x "
                         f"{tuple(x.shape)} {x.dtype}, residual {tuple(residual.shape)} {residual.dtype}")
    if rows is not None and (rows.dim() != 1 or rows.device != residual.device or rows.stride(0) not in (0, 1)
                             or rows.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"rows must be a contiguous 1-d int32/int64 index tensor on residual's device; got "
                         f"{tuple(rows.shape)} {rows.dtype}")
    n = residual.shape[0] if rows is None else rows.shape[0]
    out = torch.empty(n, residual.shape[1], dtype=residual.dtype, device=residual.device)
    if n:
        kernel = jitted(_add_rms_norm_kernel, interpreted(residual))
        block = next_power_of_2(residual.shape[1])
        src = residual if x is None else x  # an unused pointer when HAS_X is False
        kernel[(n,)](src, residual, weight, out, residual if rows is None else rows, src.stride(0),
                     residual.stride(0), out.stride(0), residual.shape[1], eps, HAS_X=x is not None,
                     HAS_ROWS=rows is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return out

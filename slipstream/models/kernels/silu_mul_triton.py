"""SiLU(gate) * up as one Triton kernel: the MLP's activation, reading the fused gate-up output.

The reference MLP (llama/model.py) runs `F.silu(gate) * up`: two elementwise launches on the GPU. Here
one program per (row, column block) reads gate and up, which may be the two column halves of one
fused [T, 2 * intermediate] projection output (strided views: each row is addressed through its
own stride), and writes a fresh contiguous [T, intermediate].

Rounding follows the reference: silu is computed in fp32 and rounded to the activation dtype
(what F.silu does for bf16/fp16), then the product is computed in fp32 and rounded once. Only the
exp implementation differs. Graph-capturable: no host reads of device values; allocates only its
output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.models.kernels.triton_jit import interpreted, jitted, next_power_of_2, cdiv, require_triton, tl, triton

BLOCK = 1024  # columns per program

if triton is not None:
    def _silu_mul_kernel(G, U, Y, stride_g, stride_u, stride_y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_cols
        g = tl.load(G + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * stride_y + offs, (act * u).to(Y.dtype.element_ty), mask=mask)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [T, I] activations (each with a contiguous last dim); a new [T, I]."""
    require_triton("silu_mul_triton")
    if gate.dim() != 2 or up.shape != gate.shape or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(f"expected gate, up [T, I] of one shape with a contiguous last dim; got "
                         f"{tuple(gate.shape)}, {tuple(up.shape)}")
    if up.dtype != gate.dtype or up.device != gate.device:
        raise TypeError(f"gate and up must share dtype and device; got {gate.dtype}/{up.dtype}")
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel():
        block = min(BLOCK, next_power_of_2(gate.shape[1]))
        kernel = jitted(_silu_mul_kernel, interpreted(gate))
        kernel[(gate.shape[0], cdiv(gate.shape[1], block))](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), gate.shape[1], BLOCK=block, num_warps=4)
    return out

"""The MLP's gate-up matmul with SiLU(gate) * up as its epilogue: one Triton kernel for few rows.

With a fused gate-up weight the MLP is three launches: the [T, 2I] matmul, the SiLU·up kernel
(silu_mul_triton.py) and the down matmul. For a decode step (a few rows) the first two are both
launch-bound, so here one program computes a [BLOCK_M, BLOCK_N] tile of the activation: it
accumulates the gate columns n and the up columns I + n of the same rows side by side over the
hidden dim, then applies SiLU·up to the two accumulators and stores only the activation. The
[T, 2I] intermediate never reaches memory. For many rows (prefill) cuBLAS's tiling wins on
arithmetic, so the model uses this kernel only up to `TritonOptions.mlp_gemm_max_rows` rows
(llama/forward_triton.py).

Rounding follows the reference MLP: each accumulator (fp32) is rounded to the activation dtype as
the gate/up matmuls' outputs are, silu is rounded, and the product is rounded once. Only the
summation order over the hidden dim differs. fp32 dots run in exact ieee mode, not tf32 (as
torch's default matmul). Graph-capturable: no host reads of device values; allocates only its
output.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from slipstream.models.kernels.triton_jit import interpreted, jitted, next_power_of_2, cdiv, require_triton, tl, triton

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    def _gate_up_silu_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                             DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        rows = offs_m.to(tl.int64)
        cols = offs_n.to(tl.int64)
        acc_g = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        acc_u = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(X + rows[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
            wg = tl.load(W + cols[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(W + (cols[None, :] + N) * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
            x = x.to(DOT_DTYPE)
            acc_g += tl.dot(x, wg.to(DOT_DTYPE), input_precision=PRECISION)
            acc_u += tl.dot(x, wu.to(DOT_DTYPE), input_precision=PRECISION)
        out_ty = Y.dtype.element_ty
        g = acc_g.to(out_ty).to(tl.float32)
        u = acc_u.to(out_ty).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        tl.store(Y + rows[:, None] * stride_ym + offs_n[None, :], (act * u).to(out_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def launch_config(rows: int, hidden: int, dtype: torch.dtype) -> dict:
    """Tile sizes, warps and stages for `rows` token rows, all spill-free on sm_90 with at most
    24 KB of shared memory (tools/gpu/kernel_resources.py, cuobjdump -res-usage). Decode (<= 16 rows)
    is a weight-streaming problem: narrow column tiles give many programs to spread the weight
    reads over the SMs (96 for SmolLM2's 1536 columns), and long K tiles with three stages keep
    few dependent round trips to memory per program. Timings are pending a GPU."""
    f32 = dtype == torch.float32
    if rows <= 16:  # tl.dot needs every tile dim >= 16
        block_m, block_n, block_k, warps, stages = 16, 16, 64 if f32 else 128, 4, 3
    elif rows <= 32:
        block_m, block_n, block_k, warps, stages = 32, 32, 64, 4, 2
    else:
        block_m, block_n, block_k, warps, stages = 64, 64, 32 if f32 else 64, 8, 2
    block_k = max(16, min(block_k, next_power_of_2(hidden)))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


def gate_up_silu_reference(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """What the reference MLP computes before its down projection, from the fused weight."""
    gate, up = F.linear(x, gate_up_weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu_triton(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ W[:I].T) * (x @ W[I:].T) for x [T, hidden] and the fused W [2I, hidden]; a new [T, I]."""
    require_triton("gate_up_silu_triton")
    if (x.dim() != 2 or gate_up_weight.dim() != 2 or gate_up_weight.shape[1] != x.shape[1]
            or gate_up_weight.shape[0] % 2 or x.stride(-1) != 1 or gate_up_weight.stride(-1) != 1):
        raise ValueError(f"expected x [T, hidden] and a gate-up weight [2I, hidden], contiguous last dims; got "
                         f"{tuple(x.shape)}, {tuple(gate_up_weight.shape)}")
    if x.dtype not in _DTYPES or gate_up_weight.dtype != x.dtype or gate_up_weight.device != x.device:
        raise TypeError(f"x and the weight must share one dtype of {_DTYPES} and a device; got {x.dtype}, "
                        f"{gate_up_weight.dtype}")
    t, k = x.shape
    n = gate_up_weight.shape[0] // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t and n:
        interpret = interpreted(x)
        kernel = jitted(_gate_up_silu_kernel, interpret)
        # numpy has no bf16: the interpreter's dot would multiply raw bits, so upcast there (exact)
        dot_dtype = tl.float32 if interpret and x.dtype == torch.bfloat16 else _TL_DTYPES[x.dtype]
        cfg = launch_config(t, k, x.dtype)
        kernel[(cdiv(t, cfg["BLOCK_M"]), cdiv(n, cfg["BLOCK_N"]))](
            x, gate_up_weight, out, t, n, k, x.stride(0), gate_up_weight.stride(0), out.stride(0),
            DOT_DTYPE=dot_dtype, PRECISION="ieee" if x.dtype == torch.float32 else None, **cfg)
    return out

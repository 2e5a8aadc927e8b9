"""RMSNorm and rotary embedding as one Triton kernel each: the GPU counterparts of llama.py's
reference `RMSNorm.forward` and `rotate_half_reference`.

Why: a decode step of a small model is bound by kernel count, not by bytes or FLOPs. On an H100 the
SmolLM2-135M step ran 1365 kernels in 3.4 ms of graph replay (docs/benchmarks.md); the reference
RMSNorm is seven elementwise kernels and each rotary application five, per layer. Here each is one.

Both compute in fp32 and round once at the points the references round (the normalised activations
before the weight multiply; cos/sin to the activation dtype), so results differ from the
references only by reduction order. Both are graph-capturable: they read no device value on the
host and allocate only their output (RMSNorm) or nothing (rotary, in place).
"""
from __future__ import annotations

import torch

from slipstream.models.triton_jit import SUM_COMBINE, interpreted, jitted, require_triton, tl, triton

if triton is not None:
    def _rms_norm_kernel(X, W, Y, stride_x, stride_y, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 0, SUM_COMBINE) / n_cols + eps)
        normed = (x * rstd).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + offs, (w * normed).to(Y.dtype.element_ty), mask=mask)

    def _rotary_kernel(Q, K, POS, COS, SIN, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                       HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        if h < HEADS:
            base = Q + t * stride_qt + h * stride_qh
        else:
            base = K + t * stride_kt + (h - HEADS) * stride_kh
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        pos = tl.load(POS + t).to(tl.int64)
        # the reference rounds cos/sin to the activation dtype before multiplying; so do we
        cos = tl.load(COS + pos * stride_c + offs, mask=mask, other=0.0).to(base.dtype.element_ty).to(tl.float32)
        sin = tl.load(SIN + pos * stride_c + offs, mask=mask, other=0.0).to(base.dtype.element_ty).to(tl.float32)
        x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(base + offs, (x1 * cos - x2 * sin).to(base.dtype.element_ty), mask=mask)
        tl.store(base + HALF + offs, (x2 * cos + x1 * sin).to(base.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim of a [T, hidden] activation (x's dtype out)."""
    require_triton("rms_norm_triton")
    if x.dim() != 2 or weight.shape != x.shape[-1:] or x.stride(-1) != 1 or weight.device != x.device:
        raise ValueError(f"expected x [T, hidden] with a contiguous last dim and weight [hidden] on its device; "
                         f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty_like(x)
    if x.shape[0]:
        kernel = jitted(_rms_norm_kernel, interpreted(x))
        block = triton.next_power_of_2(x.shape[1])
        kernel[(x.shape[0],)](x, weight, out, x.stride(0), out.stride(0), x.shape[1], eps, BLOCK=block,
                              num_warps=4 if block <= 2048 else 8)
    return out


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, heads, D] and k [T, kv_heads, D] in place by the rotary tables [max_pos, D]
    (cos/sin of `cat(freqs, freqs)`, as RotaryEmbedding keeps them) at each token's position."""
    require_triton("rotary_triton")
    t, heads, d = q.shape
    if (k.dim() != 3 or k.shape[0] != t or k.shape[2] != d or d % 2 or positions.shape != (t,)
            or cos.shape != sin.shape or cos.shape[1] != d or q.dtype != k.dtype):
        raise ValueError(f"expected q [T, H, D], k [T, KVH, D] of one dtype, positions [T], cos/sin [P, D] with D "
                         f"even; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(positions.shape)}, {tuple(cos.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("q, k, cos and sin need a contiguous last dimension (and cos, sin one layout)")
    if t:
        kernel = jitted(_rotary_kernel, interpreted(q))
        kernel[(t, heads + k.shape[1])](q, k, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                        cos.stride(0), HEADS=heads, HALF=d // 2,
                                        BLOCK=triton.next_power_of_2(d // 2), num_warps=1)
    return q, k

"""Rotary embedding and the KV-cache write as one Triton kernel.

The reference path rotates q and k (rotary.py `rotate_half_reference`) and then scatters k and v
into the paged cache with two index_copy_ calls (attention.py `write_kv`): three launches a layer
on the GPU. Here one program per (token, head) does it all: a query head is rotated in place, a
key head is rotated and stored straight into the cache at its KV index (`kv_indices[token]`), a
value head is copied there. The uncached, unrotated k is never written back: attention reads keys from
the cache only.

q, k and v may be strided views of one fused QKV projection output ([T, (H + 2 KVH) * D] split by
columns), so every tensor is addressed through its own strides; only the head dim must be
contiguous. Rounding: cos/sin are rounded to the activation dtype like the reference, and each
rotated element is computed in fp32 and rounded once, where the reference also rounds the two
products (bf16/fp16 only; fp32 differs by order alone).
Graph-capturable: reads no device value on the host and allocates nothing.
"""
from __future__ import annotations

import torch

from slipstream.models.kernels.attention import write_kv
from slipstream.models.kernels.rotary import rotate_half_reference
from slipstream.models.kernels.triton_jit import interpreted, jitted, next_power_of_2, require_triton, tl, triton

if triton is not None:
    def _rotary_kv_kernel(Q, K, V, KC, VC, POS, KV_INDICES, COS, SIN,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_kct, stride_kch, stride_vct, stride_vch, stride_c,
                          HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        if h < HEADS + KV_HEADS:  # a query or key head: rotate it
            pos = tl.load(POS + t).to(tl.int64)
            dtype = Q.dtype.element_ty
            cos = tl.load(COS + pos * stride_c + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
            sin = tl.load(SIN + pos * stride_c + offs, mask=mask, other=0.0).to(dtype).to(tl.float32)
            if h < HEADS:
                src = Q + t * stride_qt + h * stride_qh
                dst = src  # in place
            else:
                src = K + t * stride_kt + (h - HEADS) * stride_kh
                dst = KC + tl.load(KV_INDICES + t).to(tl.int64) * stride_kct + (h - HEADS) * stride_kch
            x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dst + offs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
            tl.store(dst + HALF + offs, (x2 * cos + x1 * sin).to(dtype), mask=mask)
        else:  # a value head: copy it to the cache
            vh = h - HEADS - KV_HEADS
            src = V + t * stride_vt + vh * stride_vh
            dst = VC + tl.load(KV_INDICES + t).to(tl.int64) * stride_vct + vh * stride_vch
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
            tl.store(dst + HALF + offs, tl.load(src + HALF + offs, mask=mask), mask=mask)


def rotary_kv_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        kv_indices: torch.Tensor) -> None:
    """What `rotary_kv_triton` does, with the reference path's ops (rotary.py, attention.py)."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    q.copy_(rotate_half_reference(q, c, s))
    write_kv(k_cache, kv_indices, rotate_half_reference(k, c, s))
    write_kv(v_cache, kv_indices, v)


def rotary_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     kv_indices: torch.Tensor) -> None:
    """Rotate q [T, H, D] in place; rotate k [T, KVH, D] into k_cache[kv_indices] and copy v there
    into v_cache (caches [N, KVH, D], N = pages * page_size). cos/sin [max_pos, D] as RotaryEmbedding keeps them."""
    require_triton("rotary_kv_triton")
    t, heads, d = q.shape
    kv_heads = k.shape[1] if k.dim() == 3 else -1
    if (k.shape != (t, kv_heads, d) or v.shape != k.shape or d % 2 or positions.shape != (t,)
            or kv_indices.shape != (t,) or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d
            or k_cache.dim() != 3 or k_cache.shape[1:] != (kv_heads, d) or v_cache.shape != k_cache.shape):
        raise ValueError(f"expected q [T, H, D], k/v [T, KVH, D], positions/kv_indices [T], cos/sin [P, D], caches "
                         f"[N, KVH, D] with D even; got q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, positions {tuple(positions.shape)}, kv_indices {tuple(kv_indices.shape)}, "
                         f"cos {tuple(cos.shape)}, cache {tuple(k_cache.shape)}")
    if any(x.dtype != q.dtype for x in (k, v, k_cache, v_cache)):
        raise TypeError(f"q, k, v and the caches must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if any(x.stride(-1) != 1 for x in (q, k, v, k_cache, v_cache, cos)) or sin.stride() != cos.stride():
        raise ValueError("q, k, v, the caches and cos/sin need a contiguous last dimension (cos, sin one layout)")
    if t > 1 and (positions.stride(0) != 1 or kv_indices.stride(0) != 1):
        raise ValueError("positions and kv_indices must be contiguous")
    if any(x.device != q.device for x in (k, v, positions, cos, sin, k_cache, v_cache, kv_indices)):
        raise ValueError("all tensors must be on q's device")
    if t:
        kernel = jitted(_rotary_kv_kernel, interpreted(q))
        kernel[(t, heads + 2 * kv_heads)](
            q, k, v, k_cache, v_cache, positions, kv_indices, cos, sin,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), cos.stride(0),
            HEADS=heads, KV_HEADS=kv_heads, HALF=d // 2, BLOCK=next_power_of_2(d // 2), num_warps=1)

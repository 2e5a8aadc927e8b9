"""LoRA deltas on the GPU: a shrink and an expand kernel where each token reads its own adapter
(the BGMV idea: a batched gather of matrix-vector products), for a step that mixes rows of many
adapters and of the base model (docs/lora.md, "On CUDA").

The adapters' weights live in a device bank (models/lora_bank.py) of fixed shape, one entry per slot
1..max_loras (slot 0, the base model, has none), every rank padded with zeros to max_lora_rank:

    shrink:  mid[t, :] = A[slot[t] - 1] @ x[t]                A: [slots, R_total, in]
    expand:  y[t, n]  += mid[t, j(n) R : j(n) R + R] . B[slot[t] - 1][:, n]
                                                             B: [slots, R, N] (B^T, scale folded)

An input group's targets (q/k/v, gate/up) share one shrink: target j's A rows are R_total's rows
jR..jR+R. Their outputs, when they are the column blocks of one fused projection output, take one
expand: column n belongs to target j(n) = (n >= N0) + (n >= N0 + N1). A token whose slot is 0 loads
and stores nothing (its masks are off), so base rows cost a slot read per program.

Graph-capturable: the grid depends only on the shapes, never on which slots a step holds, and no
value goes to the host; the slots are a device tensor gathered from the row tables. Deterministic: each
value is a fixed-order sum over its own token's inputs in float32, no atomics, so a token's delta
does not depend on the batch around it. `mid` is float32; the output is rounded once.
"""
from __future__ import annotations

import torch

from slipstream.models.kernels.triton_jit import (SUM_COMBINE, cdiv, interpreted, jitted, next_power_of_2, require_triton,
                                                  tl, triton)

BLOCK_R = 16  # rank rows per program (shrink) and per step of the expand's rank loop
BLOCK_K = 128  # input columns per step of the shrink's loop
BLOCK_N = 64  # output columns per expand program

if triton is not None:
    def _shrink_kernel(X, SLOTS, A, MID, stride_x, stride_mid, stride_a_slot, stride_a_row, K, R_TOTAL,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        slot = tl.load(SLOTS + t)
        on = (slot > 0).to(tl.int32)  # (a base row: every bound 0, nothing loaded or stored)
        rmask = rows < R_TOTAL * on
        k_end = K * on
        a_rows = A + tl.maximum(slot - 1, 0).to(tl.int64) * stride_a_slot + rows[:, None].to(tl.int64) * stride_a_row
        acc = tl.full([BLOCK_R], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < k_end
            xk = tl.load(X + t * stride_x + ks, mask=kmask, other=0.0).to(tl.float32)
            a = tl.load(a_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += tl.reduce(a * xk[None, :], 1, SUM_COMBINE)
        tl.store(MID + t * stride_mid + rows, acc, mask=rmask)

    def _expand_kernel(MID, SLOTS, B, Y, stride_mid, stride_b_slot, stride_b_row, stride_y, N, N0, N1, R,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(SLOTS + t)
        on = (slot > 0).to(tl.int32)
        cmask = cols < N * on
        j = (cols >= N0).to(tl.int64) + (cols >= N0 + N1).to(tl.int64)  # each column's target in the group
        b_slot = B + tl.maximum(slot - 1, 0).to(tl.int64) * stride_b_slot
        acc = tl.full([BLOCK_N], 0.0, tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rs = r0 + tl.arange(0, BLOCK_R)
            mask = (rs < R)[:, None] & cmask[None, :]
            m = tl.load(MID + t * stride_mid + j[None, :] * R + rs[:, None], mask=mask, other=0.0)
            b = tl.load(b_slot + rs[:, None].to(tl.int64) * stride_b_row + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            acc += tl.reduce(m * b, 0, SUM_COMBINE)
        y = tl.load(Y + t * stride_y + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(Y + t * stride_y + cols, (y + acc).to(Y.dtype.element_ty), mask=cmask)


def _check_slots(slots: torch.Tensor, t: int, device: torch.device) -> None:
    if slots.dtype != torch.int64 or slots.shape != (t,) or slots.device != device:
        raise ValueError(f"slots must be an int64 [{t}] tensor on {device}, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {slots.device}")


def lora_shrink_triton(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """mid [T, R_total] float32: row t is a[slots[t] - 1] @ x[t] (left unwritten where slots[t] == 0).
    x: [T, K] with a contiguous last dim; a: [slots, R_total, K], a contiguous last dim (a layer's view
    of the bank)."""
    require_triton("lora_shrink_triton")
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1] or x.stride(1) != 1 or a.stride(2) != 1:
        raise ValueError(f"expected x [T, K] and a [slots, R, K] with contiguous last dims, got "
                         f"{tuple(x.shape)} and {tuple(a.shape)}")
    t, k = x.shape
    _check_slots(slots, t, x.device)
    r_total = a.shape[1]
    if out is None:
        out = torch.empty(t, r_total, dtype=torch.float32, device=x.device)
    if t and r_total:
        block_r = min(BLOCK_R, next_power_of_2(r_total))
        kernel = jitted(_shrink_kernel, interpreted(x))
        kernel[(t, cdiv(r_total, block_r))](x, slots, a, out, x.stride(0), out.stride(0), a.stride(0), a.stride(1),
                                             k, r_total, BLOCK_R=block_r, BLOCK_K=min(BLOCK_K, next_power_of_2(k)),
                                             num_warps=4)
    return out


def lora_expand_triton(mid: torch.Tensor, slots: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
                       splits: tuple[int, int] | None = None) -> None:
    """y[t] += mid[t] B[slots[t] - 1] in place, for tokens with slots[t] > 0. y: [T, N] (a column view
    of a fused output is fine); b: [slots, R, N] (B^T); mid: [T, >= targets * R] float32. `splits`:
    (N0, N1), the column counts of the group's first two targets when y holds up to three of them
    side by side (target j reads mid's columns jR..jR+R); None: one target."""
    require_triton("lora_expand_triton")
    t, n = y.shape
    if b.dim() != 3 or b.shape[2] != n or y.stride(1) != 1 or b.stride(2) != 1 or mid.stride(1) != 1:
        raise ValueError(f"expected y [T, N], b [slots, R, N] with contiguous last dims, got {tuple(y.shape)} "
                         f"and {tuple(b.shape)}")
    if mid.dtype != torch.float32 or mid.shape[0] != t:
        raise ValueError(f"mid must be float32 [{t}, R_total], got {mid.dtype} {tuple(mid.shape)}")
    _check_slots(slots, t, y.device)
    r = b.shape[1]
    n0, n1 = splits if splits is not None else (n, 0)
    targets = 1 + (n0 < n) + (n0 + n1 < n)
    if mid.shape[1] < targets * r:
        raise ValueError(f"mid has {mid.shape[1]} columns, {targets} targets of rank {r} need {targets * r}")
    if t and n and r:
        kernel = jitted(_expand_kernel, interpreted(y))
        kernel[(t, cdiv(n, BLOCK_N))](mid, slots, b, y, mid.stride(0), b.stride(0), b.stride(1), y.stride(0), n,
                                      n0, n1, r, BLOCK_N=BLOCK_N, BLOCK_R=min(BLOCK_R, next_power_of_2(r)),
                                      num_warps=4)


def lora_shrink_reference(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """lora_shrink_triton in float64 with torch ops (zeros where slots == 0)."""
    on = slots > 0
    w = a.double()[(slots - 1).clamp(min=0)]  # [T, R_total, K]
    mid = torch.bmm(w, x.double().unsqueeze(2)).squeeze(2)
    return torch.where(on[:, None], mid, torch.zeros_like(mid))


def lora_expand_reference(mid: torch.Tensor, slots: torch.Tensor, b: torch.Tensor, y: torch.Tensor,
                          splits: tuple[int, int] | None = None) -> torch.Tensor:
    """lora_expand_triton's sum in float64 (a new tensor: y + the deltas)."""
    t, n = y.shape
    r = b.shape[1]
    n0, n1 = splits if splits is not None else (n, 0)
    cols = torch.arange(n, device=y.device)
    j = (cols >= n0).long() + (cols >= n0 + n1).long()
    idx = j[None, :] * r + torch.arange(r, device=y.device)[:, None]  # [R, N]: mid's column per (rank, output)
    m = mid.double()[:, idx]  # [T, R, N]
    w = b.double()[(slots - 1).clamp(min=0)]  # [T, R, N]
    delta = (m * w).sum(1)
    return y.double() + torch.where((slots > 0)[:, None], delta, torch.zeros_like(delta))

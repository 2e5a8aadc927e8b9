"""The LoRA adapters of the triton backend (CUDA): every slot's weights in preallocated device buffers
of fixed shape, which the BGMV kernels of models/kernels/lora_triton.py read per token through the
token's slot (docs/lora.md, "On CUDA").

Per input group g of INPUT_GROUPS (q/k/v, o, gate/up, down), with R = max_lora_rank:

    a[g]  [max_loras, layers, targets(g) * R, in(g)]   target j's A at rows jR..jR+r, zeros past its rank
    b[g]  [max_loras, layers, R, sum out(g)]            target j's B^T (scale folded) at its output columns

Slot s (1..max_loras) is entry s - 1; slot 0, the base model, has none (the kernels skip its tokens).
A target an adapter lacks, and a layer it does not adapt, stay zero: they add exactly 0. The shapes
never change, so a captured decode graph serves any mix of slots, and any adapter installed later.

Installing is two halves: `stage` (in the reading thread) lays the adapter out on the host as one
slot's entries, in pinned memory on CUDA; `install` (on the compute stream, between two steps'
launches) copies them into the slot's entries without blocking the host. The caller hands a slot out
only when no live row reads it (api/lora.py), so a step launched before the install that reads the
slot is a finished request's (its tokens are dropped) and every step launched after it sees the whole
new adapter: stream order puts the copy after the one and before the other.
"""
from __future__ import annotations

import torch

from slipstream.models.config import ModelConfig
from slipstream.models.lora import INPUT_GROUPS, LoraWeights, target_shapes


class LoraBank:
    def __init__(self, config: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device | str):
        shapes = target_shapes(config)
        self.layers, self.max_loras, self.rank, self.dtype = config.num_layers, max_loras, max_rank, dtype
        self.device = torch.device(device)
        self.a: list[torch.Tensor] = []
        self.b: list[torch.Tensor] = []
        self.columns: list[tuple[int, ...]] = []  # per group: each target's first output column, then the end
        for group in INPUT_GROUPS:
            n_in = shapes[group[0]][0]
            cols = [0]
            for t in group:
                cols.append(cols[-1] + shapes[t][1])
            self.columns.append(tuple(cols))
            self.a.append(torch.zeros(max_loras, self.layers, len(group) * max_rank, n_in, dtype=dtype, device=self.device))
            self.b.append(torch.zeros(max_loras, self.layers, max_rank, cols[-1], dtype=dtype, device=self.device))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.a, *self.b))

    def stage(self, weights: LoraWeights) -> tuple[torch.Tensor, ...]:
        """One slot's entries of every buffer (a[0..3], then b[0..3]) on the host, from `weights`
        (blocking work, meant for the reading thread)."""
        pin = self.device.type == "cuda"
        staged = [torch.zeros(t.shape[1:], dtype=self.dtype, pin_memory=pin) for t in (*self.a, *self.b)]
        r = self.rank
        for layer, groups in enumerate(weights.layers):
            for g, w in enumerate(groups):
                if w is None:
                    continue
                a, b, cols = staged[g][layer], staged[len(INPUT_GROUPS) + g][layer], self.columns[g]
                for target, lo, hi, bt in w.b:
                    j = INPUT_GROUPS[g].index(target)
                    if hi - lo > r:
                        raise ValueError(f"{weights.name}: rank {hi - lo} is above the bank's {r}")
                    a[j * r:j * r + hi - lo].copy_(w.a[lo:hi])
                    b[:hi - lo, cols[j]:cols[j + 1]].copy_(bt)
        return tuple(staged)

    def install(self, slot: int, staged: tuple[torch.Tensor, ...]) -> None:
        """Copy `stage`'s entries into `slot` (>= 1) on the current stream (the compute stream: ordered
        between the steps launched before and after), without waiting for the copy."""
        assert 1 <= slot <= self.max_loras, f"slot {slot} is not in 1..{self.max_loras}"
        for buf, host in zip((*self.a, *self.b), staged):
            buf[slot - 1].copy_(host, non_blocking=True)

    def add(self, slots: torch.Tensor, layer: int, group: int, x: torch.Tensor, outs: list[torch.Tensor],
            fused: torch.Tensor | None = None) -> None:
        """Each token's delta for input group `group` of `layer` (input x [T, in]), added in place into
        `fused` (the group's targets side by side, [T, sum out]) or into `outs` (one [T, out] per target
        in INPUT_GROUPS' order); `slots` [T] int64 on the device."""
        from slipstream.models.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

        mid = lora_shrink_triton(x, slots, self.a[group][:, layer])
        b, cols = self.b[group][:, layer], self.columns[group]
        if fused is not None:
            lora_expand_triton(mid, slots, b, fused, (cols[1], cols[2] - cols[1]) if len(cols) > 2 else None)
            return
        r = self.rank
        for j, y in enumerate(outs):
            lora_expand_triton(mid[:, j * r:], slots, b[:, :, cols[j]:cols[j + 1]], y)

"""One matrix for the q/k/v projections and one for gate/up: fewer matmul launches on the GPU.

A decode step multiplies a few rows by every weight matrix; for a small model each matmul is a
few microseconds of launch latency rather than of memory traffic, so q, k, v (three launches) and
gate, up (two) become one launch each. Checkpoints keep their names and loading is unchanged:
fusion runs afterwards, on the model at its final device and dtype.

The fused matrix is built once by concatenation, and each original nn.Linear is then re-pointed
at its rows of it (a view), so memory holds one copy of the weights and the state dict, the
reference path and the unfused layers still see the same numbers. Projections that are not
plain nn.Linear (the CPU path's oneDNN-packed PackedLinear, which has no dense weight) are left
unfused; the model then runs them one by one.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


def fuse_linears(linears: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [sum(out), in], bias or None) of `linears` stacked by output rows, with each layer's
    parameters re-pointed at their rows; None (nothing changed) unless all are dense nn.Linear of
    one input size, dtype and device, with biases on all or none."""
    if not linears or not all(type(m) is nn.Linear for m in linears):
        return None
    first = linears[0].weight
    if any(m.weight.shape[1] != first.shape[1] or m.weight.dtype != first.dtype or m.weight.device != first.device
           for m in linears):
        return None
    has_bias = [m.bias is not None for m in linears]
    if any(has_bias) != all(has_bias):
        return None
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    at = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[at:at + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[at:at + n], requires_grad=False)
        at += n
    return weight, bias


def is_fused_view(linear: nn.Module, fused: torch.Tensor) -> bool:
    """Whether `linear`'s weight still lives inside `fused` (a reload replaces it and breaks fusion)."""
    w = getattr(linear, "weight", None)
    return isinstance(w, torch.Tensor) and w.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()

"""Jitting this package's Triton kernels for the compiler or for Triton's interpreter.

Triton fixes a kernel's mode when `triton.jit` runs, so each kernel is jitted lazily, once per mode:
compiled for CUDA tensors, interpreted (numpy) for CPU tensors, which is how the tests run the
GPU kernels without a GPU. Kernels use builtins only: tl.sum/tl.max are themselves jitted
functions fixed to one mode at import, so reductions go through `tl.reduce` with the combine
functions below, which the interpreter recognises.

Only the triton backend imports this module (models/llama/model.py imports llama_triton when the backend
is chosen), so the reference path never touches triton. Without triton every kernel module still
imports (its kernels undefined, the combine functions None) and a kernel call raises
DeviceUnavailableError through `require_triton`.
"""
from __future__ import annotations

import torch

from slipstream.errors import DeviceUnavailableError

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference paths need no triton; complain only when a kernel is used
    triton = None
    tl = None

MAX_COMBINE = SUM_COMBINE = None  # the kernel modules import them by name, with or without triton
if triton is not None:
    MAX_COMBINE = getattr(tl.standard, "_elementwise_max", None)
    SUM_COMBINE = getattr(tl.standard, "_sum_combine", None)
    if MAX_COMBINE is None or SUM_COMBINE is None:  # a triton that renamed them: our own (compiled use)
        @triton.jit
        def MAX_COMBINE(a, b):
            return tl.maximum(a, b)

        @triton.jit
        def SUM_COMBINE(a, b):
            return a + b

_JITTED: dict[tuple[object, bool], object] = {}


def require_triton(what: str) -> None:
    if triton is None:
        raise DeviceUnavailableError(f"{what} needs the `triton` package (pip install 'slipstream[gpu]'); "
                                     "the reference backend needs none")


def interpreted(t: torch.Tensor) -> bool:
    """CPU tensors can only run interpreted; on a GPU honour TRITON_INTERPRET like any triton kernel."""
    return t.device.type == "cpu" or triton.knobs.runtime.interpret


def jitted(fn, interpret: bool):
    """`fn` jitted for the compiler or the interpreter, once per mode."""
    k = _JITTED.get((fn, interpret))
    if k is None:
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = interpret
            k = _JITTED[(fn, interpret)] = triton.jit(fn)
    return k

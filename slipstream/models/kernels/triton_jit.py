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

By default (SLIPSTREAM_THIN_LAUNCH=0 turns it off; triton_launch.py) compiled kernels come back
wrapped in a `ThinKernel`, which launches a specialisation Triton has already compiled without Triton's
per-launch Python; the interpreter always gets the plain JITFunction.
"""
from __future__ import annotations

import torch

from slipstream.errors import DeviceUnavailableError
from slipstream.models.kernels import triton_launch

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
_THIN: dict[object, triton_launch.ThinKernel] = {}  # fn -> its compiled JITFunction, thinly launched


def require_triton(what: str) -> None:
    if triton is None:
        raise DeviceUnavailableError(f"{what} needs the `triton` package (in the slipstream checkout, "
                                     '.venv/bin/pip install -e ".[gpu]"); the reference backend needs none')


def interpreted(t: torch.Tensor) -> bool:
    """CPU tensors can only run interpreted; on a GPU honour TRITON_INTERPRET like any triton kernel."""
    return t.is_cpu or triton.knobs.runtime.interpret  # (is_cpu: no torch.device built per launch)


# triton.cdiv and triton.next_power_of_2 are constexpr functions since triton 3.4: called from host
# code each costs an import statement and two comprehensions (~2 µs), several times per launch
def cdiv(a: int, b: int) -> int:
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def jitted(fn, interpret: bool):
    """`fn` jitted for the compiler or the interpreter, once per mode (compiled and the thin launcher
    on: a ThinKernel around the same JITFunction, so both paths share Triton's compile cache)."""
    if not interpret and triton_launch.enabled():
        t = _THIN.get(fn)
        if t is None:
            t = _THIN[fn] = triton_launch.ThinKernel(_jit(fn, False))
        return t
    return _jit(fn, interpret)


def _jit(fn, interpret: bool):
    k = _JITTED.get((fn, interpret))
    if k is None:
        with triton.knobs.runtime.scope():
            triton.knobs.runtime.interpret = interpret
            k = _JITTED[(fn, interpret)] = triton.jit(fn)
    return k

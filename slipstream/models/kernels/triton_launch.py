"""A thin launcher for this package's compiled Triton kernels (on by default; SLIPSTREAM_THIN_LAUNCH=0 turns it off).

Triton's `kernel[grid](*args)` spends host time before the launch itself: it binds the arguments,
specialises each one (type; divisibility by 16 of pointers and ints; ints equal to 1), formats a
cache key (`str` of the options), looks the compiled kernel up, builds launch metadata for its
hooks and, in the C launcher, asks the driver about every pointer. An eager forward makes ~150
such launches per step (docs/cuda.md, "Thin launches").

`ThinKernel` keeps Triton as the only compiler and key authority: the first launch of each
specialisation goes through `JITFunction.run`, which compiles (or finds) the kernel and launches it;
the thin launcher records the compiled kernel under its own key and launches later calls with that
key straight through the compiled kernel's launcher. The key (built in `ThinKernel.launch` from a
`make_keyer` function) is at least as fine as Triton's: per positional argument its type and what
Triton specialises it on (tensor: dtype and data_ptr % 16; int: == 1, % 16 and the i32/i64/u64
range), the keyword arguments (constexprs and options) by value, the current device and the global
knobs Triton folds into its key. So two launches that share a key share Triton's key too: never a
kernel compiled for another alignment or value. Anything it does not model (a constexpr passed
positionally, a runtime argument by keyword, a tuple or descriptor argument, a callable grid,
launch or pre-run hooks) takes Triton's own path every time. Pointers reach the launcher as
integers (their alignment was read anyway), which skips the C launcher's per-pointer driver query;
the keyer refuses a tensor that is not on a CUDA device, so a host pointer never reaches a kernel.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

try:
    import triton
    from triton import knobs as _knobs
except ImportError:  # triton_jit.require_triton reports it
    triton = _knobs = None

_OFF = ("0", "false", "no", "off", "")
# on since an H100 run (docs/results/h100-2026-11-27/kernels-ecc4e48/): the engine's CUDA tests pass with
# it, and an eager mixed step's host launch fell 16-20%
_enabled = os.environ.get("SLIPSTREAM_THIN_LAUNCH", "1").strip().lower() not in _OFF

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_ONE = 8  # an int's code for the value 1 (Triton makes it a constexpr); see int_code


def enabled() -> bool:
    return _enabled


def set_enabled(on: bool) -> None:
    """Process-wide switch (the env knob's default); tools flip it to compare both launch paths."""
    global _enabled
    _enabled = bool(on)


class NotThin(Exception):
    """An argument the thin key does not model: the launch takes Triton's own path."""


def int_code(a: int) -> int:
    """What Triton specialises a runtime int on: == 1 (a constexpr), else its type (i32, i64, u64)
    and divisibility by 16. The i32 codes are 0/1 (the keyers inline them as a bool), the rest differ."""
    if a == 1:
        return _ONE
    if _I32_MIN <= a <= _I32_MAX:
        return a & 15 == 0
    if -(1 << 63) <= a < (1 << 63):
        return 2 + (a & 15 == 0)
    if 0 <= a < (1 << 64):
        return 4 + (a & 15 == 0)
    raise NotThin("an int beyond 64 bits")  # Triton raises on it: let it


Keyer = Callable[..., tuple[tuple, tuple]]


def make_keyer(types: tuple[type, ...]) -> Keyer | None:
    """For positional args of these exact types: a function of them returning (key, launch args),
    the key holding what Triton specialises each on beyond its type (tensor: dtype and data_ptr % 16;
    int: int_code; bool, float, None: nothing), the launch args with tensors as data pointers. It
    raises NotThin for a tensor off the GPU or an int beyond 64 bits. Generated once per type tuple
    (a loop with a branch per argument costs as much as Triton's own binder). None: a type it does
    not model."""
    names, checks, ptrs, key, out = [], [], [], [], []
    for i, t in enumerate(types):
        a = f"a{i}"
        names.append(a)
        if issubclass(t, torch.Tensor):
            checks.append(f"{a}.is_cuda")
            ptrs.append(f"p{i} = {a}.data_ptr()")
            key += [f"{a}.dtype", f"p{i} & 15 == 0"]
            out.append(f"p{i}")
        elif t is int:
            key.append(f"({a} & 15 == 0 if {_I32_MIN} <= {a} <= {_I32_MAX} and {a} != 1 else int_code({a}))")
            out.append(a)
        elif t in (bool, float, type(None)):  # Triton: u1, fp32, constexpr None; the type is in the key
            out.append(a)
        else:
            return None
    body = [f"def keyer({', '.join(names)}):"]
    if checks:
        body.append(f"    if not ({' and '.join(checks)}):")
        body.append("        raise NotThin('a tensor off the GPU')")
    body += [f"    {p}" for p in ptrs]
    body.append(f"    return ({''.join(k + ', ' for k in key)}), ({''.join(o + ', ' for o in out)})")
    scope: dict[str, Any] = {"int_code": int_code, "NotThin": NotThin}
    exec("\n".join(body), scope)  # noqa: S102 - code built above from a fixed template
    return scope["keyer"]


def _knob_state() -> tuple | None:
    """The process-wide knobs Triton adds to a launch's key (debug, instrumentation, sanitizer,
    inspection pipeline); None when a launch hook would run (the thin launch skips them)."""
    r, c = _knobs.runtime, _knobs.compilation
    for h in (r.launch_enter_hook, r.launch_exit_hook):  # a HookChain since triton 3.5, a callable before
        if h is not None and getattr(h, "calls", True):
            return None
    return (r.debug, c.instrumentation_mode, getattr(c, "fpsan_homomorphic_casts", None),
            getattr(r, "add_stages_inspection_hook", None))


class ThinKernel:
    """A compiled-mode JITFunction, launched as `kernel[grid](*args, **kwargs)` like the original."""

    __slots__ = ("fn", "entries", "keyers", "lead", "runtime_names", "hits", "misses", "fallbacks")

    def __init__(self, fn) -> None:
        self.fn = fn
        self.entries: dict[tuple, tuple] = {}
        self.keyers: dict[tuple, Keyer | None] = {}
        # positional args may cover only the leading runtime parameters: a constexpr's value is keyed
        # only when it comes by keyword
        self.lead = next((p.num for p in fn.params if p.is_constexpr), len(fn.params))
        # a runtime argument by keyword would be keyed by value (a tensor by identity): Triton's path
        self.runtime_names = frozenset(p.name for p in fn.params if not p.is_constexpr)
        self.hits = self.misses = self.fallbacks = 0

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        fn = self.fn
        types = tuple(map(type, args))
        try:
            keyer = self.keyers[types]
        except KeyError:
            keyer = self.keyers[types] = make_keyer(types)
        if (keyer is None or not _enabled or len(args) > self.lead or type(grid) is not tuple or fn.pre_run_hooks
                or not self.runtime_names.isdisjoint(kwargs)):
            return self._triton(grid, args, kwargs)
        knobs = _knob_state()
        if knobs is None:
            return self._triton(grid, args, kwargs)
        try:
            arg_key, launch_args = keyer(*args)
        except NotThin:
            return self._triton(grid, args, kwargs)
        drv = triton.runtime.driver.active
        device = drv.get_current_device()
        key = ((device, fn.debug), knobs, tuple(kwargs.items()), types, arg_key)
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            kernel = fn.run(*args, grid=grid, warmup=False, **kwargs)  # compiles if needed, launches
            self._record(key, kernel, len(args), kwargs)
            return kernel
        for (name, _), (val, globals_dict) in fn.used_global_vals.items():
            if globals_dict.get(name, _NOTHING) != val:  # what Triton checks on every launch: let it raise
                return self._triton(grid, args, kwargs)
        run, function, metadata, tail, kernel = entry
        self.hits += 1
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, drv.get_current_stream(device),
            function, metadata, None, None, None, *launch_args, *tail)
        return kernel

    def _triton(self, grid, args: tuple, kwargs: dict):
        self.fallbacks += 1
        return self.fn.run(*args, grid=grid, warmup=False, **kwargs)

    def _record(self, key: tuple, kernel, n_args: int, kwargs: dict) -> None:
        if kernel is None or hasattr(kernel, "result"):  # a compile hook skipped it, or an async compile
            return
        tail = []  # every parameter after the positional ones, as Triton binds it (constexprs included)
        for p in self.fn.params[n_args:]:
            if p.name in kwargs:
                tail.append(kwargs[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                return
        self.entries[key] = (kernel.run, kernel.function, kernel.packed_metadata, tuple(tail), kernel)


_NOTHING = object()

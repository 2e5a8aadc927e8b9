"""Counting the kernel launches of a forward on the CPU, where no GPU profiler can.

On the triton backend a CPU forward runs the same torch ops and Triton kernels a GPU forward would
launch (the kernels interpreted). `count_launches()` records, in order, every torch op that computes
something (views and empty allocations launch nothing on a GPU either) and every Triton kernel
launch (whose own torch ops inside the interpreter are not counted). Used by
tests/test_kernel_launches.py and tools/profile/count_launches.py; a test and debugging aid, not used by
the engine.
"""
from __future__ import annotations

import contextlib
import importlib

from torch.utils._python_dispatch import TorchDispatchMode

from slipstream.models.kernels import triton_jit

# every module that launches a Triton kernel through `jitted` (each imported it by name)
KERNEL_MODULES = ("add_norm_triton", "attention_triton", "decode_fused_triton", "gate_up_silu_triton",
                  "rotary_kv_triton", "silu_mul_triton")
NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh"}


class LaunchCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.launches: list[str] = []
        self._inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside_triton and not func.is_view and name not in NO_KERNEL:
            self.launches.append(name)
        return func(*args, **(kwargs or {}))

    def counting_jitted(self, fn, interpret: bool):
        """triton_jit.jitted, with each launch recorded."""
        kernel, counter = triton_jit.jitted(fn, interpret), self

        class Launch:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    counter.launches.append(fn.__name__)
                    counter._inside_triton += 1
                    try:
                        return kernel[grid](*args, **kwargs)
                    finally:
                        counter._inside_triton -= 1
                return run
        return Launch()


@contextlib.contextmanager
def count_launches():
    """Yields a LaunchCounter whose `launches` lists what ran inside the block."""
    counter = LaunchCounter()
    modules = [importlib.import_module(f"slipstream.models.kernels.{name}") for name in KERNEL_MODULES]
    saved = [m.jitted for m in modules]
    for m in modules:
        m.jitted = counter.counting_jitted
    try:
        with counter:
            yield counter
    finally:
        for m, jitted in zip(modules, saved):
            m.jitted = jitted

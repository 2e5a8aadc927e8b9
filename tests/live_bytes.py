"""LiveBytes: the peak bytes of tensors that torch ops create under it and that are alive at once,
for measuring a function's temporaries on the CPU (tests/test_memory_budget.py)."""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map


class LiveBytes(TorchDispatchMode):
    """A storage counts from the op that creates it until the tensor that first held it is
    collected (a view kept longer is not counted: good enough for chains of [n, V] temporaries).
    Dispatch modes are per thread: enter it on the thread that runs the ops."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = set()
        tree_map(lambda t: inputs.add(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) else None,
                 (args, kwargs))
        out = func(*args, **(kwargs or {}))

        def track(t):
            if isinstance(t, torch.Tensor):
                key, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if n and key not in self.seen and key not in inputs:  # a new storage, not an in-place result
                    self.seen.add(key)
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._gone, key, n)
            return t

        tree_map(track, out)
        return out

    def _gone(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)

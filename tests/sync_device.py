"""A CPU stand-in for CUDA's host/device split, with a sync detector (the CPU twin of
`torch.cuda.set_sync_debug_mode("error")`, which tests/test_cuda_runtime.py uses on a GPU).

`SeparateMemoryDevice` is the CPU device with `unified_memory = False`: step inputs are staged in
host buffers and copied to distinct "device" tensors on the upload stream, tokens copied back on
the copy stream, as on CUDA; its streams are the CPU device's worker threads, so launched work runs
later than its launch (at least as asynchronous as a GPU). What CUDA runs on the host at launch —
the runner's launch code and every function launched on a stream, which on CUDA only enqueues
kernels — runs here under `SyncDetector`, which records each operation that would make a CUDA host
wait for the device:
  * reading device memory on the host: item, tolist, cpu, numpy, bool/int/float of a tensor that is
    not a host buffer (`Device.host_buffer`);
  * a blocking copy: `Tensor.to(device)` without non_blocking, `copy_` between a host buffer and
    device memory without non_blocking, `torch.tensor` / `as_tensor` with a device;
  * data-dependent shapes: nonzero, masked_select, indexing by a bool tensor.
Inside the model's forward the detector is paused: the model is the same for every kind of step
and CUDA's own tests hold it (a captured graph cannot sync); the CPU kernels read their tables
with numpy. Tests call `use_torch_paths` first, so the runner takes the branches it takes on CUDA
(the numpy fast paths are chosen by `device.type == "cpu"`)."""
from __future__ import annotations

import threading
import time
import traceback

import torch
from torch.overrides import TorchFunctionMode

from slipstream.runtime.devices.cpu_device import CPUDevice, CPUStream

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
_SHAPES = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select}
_paused = threading.local()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class SyncDetector(TorchFunctionMode):
    def __init__(self, device: "SeparateMemoryDevice"):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not getattr(_paused, "on", False):
            why = self.device.why_sync(func, args, kwargs)
            if why is not None:
                self.device.syncs.append(f"{why}\n" + "".join(traceback.format_stack(limit=8)[:-1]))
        return func(*args, **kwargs)


class SeparateMemoryDevice(CPUDevice):
    unified_memory = False

    def __init__(self, forward_threads: int | None = None, upload_delay_s: float = 0.0):
        super().__init__(forward_threads)
        # uploads on a stream of their own, `upload_delay_s` late each: a host buffer rewritten before
        # its copy ran would hand the step another step's inputs
        self.upload = CPUStream("upload")
        self.upload_delay_s = upload_delay_s
        self.host_storages: set[int] = set()
        self.syncs: list[str] = []
        self.launches: list[tuple[str, str]] = []  # (stream, label) of what was launched while checking
        self.checking = False  # set by the test once warm (first-use allocations are not steady state)
        for stream in (self.compute, self.copy, self.upload):
            self._checked(stream)

    def recover(self) -> bool:
        self.upload.clear_error()
        return super().recover()

    def close(self) -> None:
        self.upload.close()
        super().close()

    def host_buffer(self, shape, dtype):
        t = torch.empty(shape, dtype=dtype)
        self.host_storages.add(_storage(t))
        return t

    def _is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and _storage(t) in self.host_storages

    def _checked(self, stream) -> None:
        launch = stream.launch

        def checked(fn, label=""):
            if self.checking:
                self.launches.append((stream.name, label))

            def run():
                if stream is self.upload and self.upload_delay_s:
                    time.sleep(self.upload_delay_s)
                self.run_checked(fn)

            launch(run, label)

        stream.launch = checked

    def run_checked(self, fn, *args, **kwargs):
        """fn(...) under the detector, as CUDA host code (while `checking`)."""
        if not self.checking:
            return fn(*args, **kwargs)
        with SyncDetector(self):
            return fn(*args, **kwargs)

    def why_sync(self, func, args, kwargs) -> str | None:
        name = getattr(func, "__qualname__", repr(func))
        if func in _READS and isinstance(args[0], torch.Tensor) and not self._is_host(args[0]):
            return f"{name} reads device memory on the host"
        if func in _SHAPES:
            return f"{name}: a data-dependent shape"
        if func is torch.Tensor.__getitem__ and isinstance(args[1], torch.Tensor) and args[1].dtype == torch.bool:
            return "indexing by a bool tensor: a data-dependent shape"
        if func is torch.Tensor.to and not kwargs.get("non_blocking", False):
            if kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args[1:]):
                return "Tensor.to(device) without non_blocking: a blocking copy"
        if func is torch.Tensor.copy_ and not (kwargs.get("non_blocking", False) or (len(args) > 2 and args[2])):
            if self._is_host(args[0]) != self._is_host(args[1]):
                return "copy_ between host and device memory without non_blocking: a blocking copy"
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            return f"{name}(..., device=...): a blocking copy"
        return None


def pause_in(module: torch.nn.Module) -> None:
    """No detection inside `module`'s forward (see the module docstring)."""
    forward = module.forward

    def paused(*args, **kwargs):
        was, _paused.on = getattr(_paused, "on", False), True
        try:
            return forward(*args, **kwargs)
        finally:
            _paused.on = was

    module.forward = paused


def check_runner(device: SeparateMemoryDevice, runner) -> None:
    """The runner's launch code (what the loop thread runs to launch a step) under the detector too."""
    for name in ("launch_forward", "launch_sampling"):
        method = getattr(runner, name)
        setattr(runner, name, lambda *a, _m=method, **k: device.run_checked(_m, *a, **k))
    pause_in(runner.model)


def use_torch_paths(monkeypatch) -> None:
    """The runner's CUDA branches on the CPU: the n-gram proposal, greedy argmax and replay
    acceptance in torch ops (their numpy twins are chosen by the tensors' device type)."""
    from slipstream.speculation import ngram_drafter, runner as spec_step, verify as spec_verify

    monkeypatch.setattr(ngram_drafter.NgramDrafter, "propose", ngram_drafter.NgramDrafter._propose_torch)
    monkeypatch.setattr(spec_verify, "replay_accept", spec_verify._replay_accept_torch)
    monkeypatch.setattr(spec_step, "replay_accept", spec_verify._replay_accept_torch)
    monkeypatch.setattr(spec_step, "_argmax", lambda logits: logits.argmax(-1))

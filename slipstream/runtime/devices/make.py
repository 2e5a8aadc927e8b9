"""The Device an EngineConfig names (`device="cpu"` or `"cuda"`): its own module, apart from the
interface (device.py) that both implementations import."""
from __future__ import annotations

from slipstream.runtime.devices.device import Device


def make_device(kind: str, event_wait: str = "auto", cpu_forward_threads: int | None = None) -> Device:
    """`cpu_forward_threads`: intra-op threads of the CPU device's compute stream (None: its default)."""
    if kind == "cpu":
        from slipstream.runtime.devices.cpu_device import CPUDevice

        return CPUDevice(cpu_forward_threads)
    if kind == "cuda":
        from slipstream.runtime.devices.cuda_device import CUDADevice

        return CUDADevice(event_wait=event_wait)
    raise ValueError(f"unknown device {kind!r}; expected 'cpu' or 'cuda'")

"""The device interface the engine loop is written against: streams, events, host buffers.

A `Stream` runs launched work in FIFO order; `launch` returns at once. An exception raised by
launched work is sticky, like a CUDA error: the stream skips later work, and every event recorded
after it (on that stream, or on a stream that waited on it) re-raises it to its waiter, until
`Device.recover`. An `Event` is recorded on
one stream and can be waited on by another stream (without the host) or awaited by the asyncio
loop (without blocking it). The CPU implementation emulates this with worker threads; the CUDA
implementation (cuda_device.py) maps it to torch streams and events. The scheduler only ever sees
this interface.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import torch


class Event(Protocol):
    def query(self) -> bool:
        """True once all work recorded before it on its stream has finished."""

    def synchronize(self) -> None:
        """Block the calling thread until the event completes (tests, shutdown)."""

    async def wait_async(self) -> None:
        """Await completion from the asyncio loop without blocking it."""


class Mark(Protocol):
    """A point of a stream's timeline (`Stream.mark`)."""

    def ms_to(self, end: Any) -> float | None:
        """Milliseconds of stream time from this mark to `end`, once both have run (read it after an
        event recorded behind `end` completed); None where the stream skipped them (a failed step)."""


class Stream(Protocol):
    name: str

    def launch(self, fn: Callable[[], None], label: str = "") -> None:
        """Enqueue `fn`, which issues device work; it runs after everything launched before it."""

    def record(self) -> Event:
        """A fresh event that completes when work launched so far on this stream is done."""

    def mark(self) -> Mark:
        """A timestamp taken when the stream reaches it (the cost of steps, as the device sees it)."""

    def wait(self, event: Event) -> None:
        """Work launched later on this stream starts only after `event` completes; if the work
        behind `event` failed, this stream fails too (it skips later work until recovered)."""

    def flush_spans(self) -> None:
        """Report finished labeled work to `busy_hook` (tracing) if it was not reported as it finished."""


class Device(Protocol):
    kind: str
    torch_device: torch.device
    # read-only properties, so a device may hold its own stream type (a Protocol attribute is invariant)
    @property
    def compute(self) -> Stream:
        """Forward and sampling."""

    @property
    def upload(self) -> Stream:
        """Host→device copies of step inputs and masks."""

    @property
    def copy(self) -> Stream:
        """Device→host copies of sampled tokens."""

    unified_memory: bool  # host buffers are device memory: staging needs no upload

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor that device copies can target asynchronously (pinned on CUDA)."""

    def recover(self) -> bool:
        """After a failure, once nothing is in flight: clear sticky stream errors. False if the
        device cannot run new work (a CUDA context error): the engine must stop."""

    def free_memory(self) -> int:
        """Device bytes the driver reports free (0 where memory is the host's)."""

    def release_memory(self) -> None:
        """After an engine let go of everything on the device: hand what the allocator caches back
        to the driver, so the next engine (sized from free memory) gets it."""

    def close(self) -> None: ...

"""The CUDA device: torch streams and events, pinned host buffers, events awaited from asyncio.

Streams: `compute` (forward and sampling of both slots, in launch order), `upload` (host→device
copies of step inputs and masks from pinned buffers) and `copy` (device→host copies of sampled
tokens). Separate upload and download streams keep an input upload of step t+1 from queueing
behind the download of step t, which waits on step t's sampling. `launch` calls `fn` at once on
the host with the stream current: torch kernel launches are already asynchronous.

Awaiting an event without blocking the asyncio loop (EngineConfig.event_wait):
  host_func  a waiter stream waits on the event, then runs a CUDA host function (through cupy)
             that wakes the loop with call_soon_threadsafe; no thread is parked per wait.
  thread     a helper thread blocks in cudaEventSynchronize, then wakes the loop.
  poll       the loop re-queries the event every iteration (lowest latency, burns the loop).
tools/gpu/bench_event_wait.py measures their wake-up latency; "auto" is thread (the faster wake-up
on an H100, docs/cuda.md); host_func is used only when asked for. cupy is imported lazily (cupy-cuda12x or cupy-cuda13x both provide it).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import time
from typing import TYPE_CHECKING, Callable

import structlog
import torch

from slipstream.errors import DeviceUnavailableError
from slipstream.runtime.devices.event_waits import EVENT_WAITS

if TYPE_CHECKING:  # (device.py makes devices: a runtime import would be a circle)
    from slipstream.runtime.devices.device import Event

log = structlog.get_logger(__name__)


def load_cupy():
    """cupy, or None when it is not installed or cannot see the GPU (the engine then waits on threads)."""
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or a CUDA/driver mismatch
        log.info("cupy_unavailable", fallback="event waits on a helper thread", reason=repr(e))
        return None


class CUDAEvent:
    __slots__ = ("event", "device", "error")

    def __init__(self, event: torch.cuda.Event, device: "CUDADevice", error: BaseException | None = None):
        self.event, self.device = event, device
        self.error = error  # a Python exception raised by work launched before it (sticky, as on the CPU)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()
        if self.error is not None:
            raise self.error

    async def wait_async(self) -> None:
        if not self.event.query():
            await self.device.waiter(self.event)
        if self.error is not None:
            raise self.error


class CUDAMark:
    """A timing event recorded on the stream (read once an event behind it completed: no wait)."""

    __slots__ = ("event",)

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(stream)

    def ms_to(self, end: "CUDAMark") -> float | None:
        return self.event.elapsed_time(end.event)


class CUDAStream:
    def __init__(self, name: str, device: "CUDADevice", stream: torch.cuda.Stream):
        self.name, self.device, self.stream = name, device, stream
        self.busy_hook: Callable[[str, object, float, float], None] | None = None  # set by the tracer
        self._timed: list[tuple[object, torch.cuda.Event, torch.cuda.Event]] = []
        self._error: BaseException | None = None

    def launch(self, fn: Callable[[], None], label: str = "") -> None:
        if self._error is not None:
            return  # a failed stream skips work until recovered (the CPU stream's rule)
        try:
            self._launch(fn, label)
        except Exception as e:  # noqa: BLE001 - surfaced through the next event, like a device error
            self._error = e

    def _launch(self, fn: Callable[[], None], label: str) -> None:
        with torch.cuda.stream(self.stream):
            if self.busy_hook is None or not label:
                fn()
                return
            self.device.start_clock()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            fn()
            end.record(self.stream)
            self._timed.append((label, start, end))

    def record(self) -> CUDAEvent:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return CUDAEvent(ev, self.device, self._error)

    def mark(self) -> CUDAMark:
        return CUDAMark(self.stream)

    def wait(self, event: Event) -> None:
        assert isinstance(event, CUDAEvent), "a stream waits only for its own device's events"
        self.stream.wait_event(event.event)
        if event.error is not None and self._error is None:
            self._error = event.error

    def clear_error(self) -> None:
        self._error = None

    def flush_spans(self) -> None:
        """Report finished timed spans to the tracer, in host perf_counter time."""
        hook = self.busy_hook
        while self._timed and self._timed[0][2].query():
            label, start, end = self._timed.pop(0)
            if hook is not None:
                hook(self.name, label, self.device.host_time(start), self.device.host_time(end))


class CUDADevice:
    kind = "cuda"
    unified_memory = False

    def __init__(self, index: int = 0, event_wait: str = "auto"):
        if not torch.cuda.is_available():
            raise DeviceUnavailableError("device='cuda' needs an NVIDIA GPU and a CUDA build of torch "
                                         f"(torch {torch.__version__}: torch.cuda.is_available() is False)")
        if event_wait not in EVENT_WAITS:
            raise ValueError(f"event_wait must be one of {EVENT_WAITS}, got {event_wait!r}")
        self.torch_device = torch.device("cuda", index)
        torch.cuda.set_device(self.torch_device)
        self.compute = CUDAStream("compute", self, torch.cuda.Stream(self.torch_device))
        self.upload = CUDAStream("upload", self, torch.cuda.Stream(self.torch_device))
        self.copy = CUDAStream("copy", self, torch.cuda.Stream(self.torch_device))
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="slipstream-event")
        self._waiter_stream = torch.cuda.Stream(self.torch_device)
        self._anchor: tuple[torch.cuda.Event, float] | None = None
        self.event_wait = self._choose(event_wait)
        self.waiter = {"host_func": self._wait_host_func, "thread": self._wait_thread,
                       "poll": self._wait_poll}[self.event_wait]
        log.info("cuda_device_ready", gpu=torch.cuda.get_device_name(self.torch_device), event_wait=self.event_wait)

    def _choose(self, event_wait: str) -> str:
        self._cupy = load_cupy() if event_wait == "host_func" else None
        if event_wait == "auto":
            # measured on an H100 (docs/cuda.md): a pool thread wakes the loop in 33-41 us, the
            # cupy host function in 84-126 us, and the thread gave 13-16% less wall time at depth 2
            return "thread"
        if event_wait == "host_func" and self._cupy is None:
            raise RuntimeError("event_wait='host_func' needs cupy (in the slipstream checkout, "
                               '.venv/bin/pip install -e ".[gpu]")')
        return event_wait

    # --- awaiting events ---------------------------------------------------------------------

    async def _wait_thread(self, event: torch.cuda.Event) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, event.synchronize)

    async def _wait_poll(self, event: torch.cuda.Event) -> None:
        while not event.query():
            await asyncio.sleep(0)

    async def _wait_host_func(self, event: torch.cuda.Event) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        # the host function runs on a CUDA driver thread and must make no CUDA calls: it only wakes the loop
        self._waiter_stream.wait_event(event)
        assert self._cupy is not None  # (this wait is chosen only when cupy imported)
        stream = self._cupy.cuda.ExternalStream(self._waiter_stream.cuda_stream)
        stream.launch_host_func(_wake, (loop, fut))
        await fut

    # --- memory and time ---------------------------------------------------------------------

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def free_memory(self) -> int:
        return torch.cuda.mem_get_info(self.torch_device)[0]

    def release_memory(self) -> None:
        """A closed engine's objects sit in reference cycles (the loop, its observers, the graphs'
        owners): collected here, so their blocks are free before the cache is emptied. This runs on
        the closing thread, which captures no graph (graph_record.py: a capture runs with the
        collector off and in thread_local mode, so another engine's capture is not disturbed)."""
        gc.collect()
        torch.cuda.empty_cache()

    def start_clock(self) -> None:
        """Tie the GPU clock to the host's once (a sync, so only when tracing starts)."""
        if self._anchor is None:
            anchor = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.torch_device)
            anchor.record(self.compute.stream)
            anchor.synchronize()
            self._anchor = (anchor, time.perf_counter())

    def host_time(self, event: torch.cuda.Event) -> float:
        """A finished timed event's time on the host perf_counter clock (tracing only)."""
        assert self._anchor is not None, "start_clock() first"
        anchor, t0 = self._anchor
        return t0 + anchor.elapsed_time(event) / 1000.0

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)

    def recover(self) -> bool:
        """Python errors of launched work are cleared; a CUDA error poisons the context for good."""
        for stream in (self.compute, self.upload, self.copy):
            stream.clear_error()
        try:
            torch.cuda.synchronize()
        except RuntimeError as e:
            log.error("cuda_context_failed", detail="the engine cannot recover", error=repr(e))
            return False
        return True

    def close(self) -> None:
        self.synchronize()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _wake(arg) -> None:
    loop, fut = arg
    try:
        loop.call_soon_threadsafe(_resolve, fut)
    except RuntimeError:  # the loop closed while the event was pending (shutdown): nobody waits any more
        pass


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)

"""A CPU device that behaves like a GPU: each stream is a worker thread draining a FIFO queue.

`launch` returns at once and the work runs on the stream's thread; torch ops release the GIL, so
the asyncio loop's bookkeeping really overlaps the forward. Events are one-shot (a fresh event
per record, so no event is ever re-armed while someone waits on it). Errors raised by launched
work are kept and re-raised to whoever next waits on that stream's events, like a sticky CUDA
error, instead of being lost on a worker thread.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # (device.py makes devices: a runtime import would be a circle)
    from slipstream.runtime.device import Event


class CPUEvent:
    __slots__ = ("_done", "_error", "_waiters", "_lock")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._lock = threading.Lock()

    def _complete(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._error = error
            self._done.set()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(_resolve, fut)

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    async def wait_async(self) -> None:
        if not self._done.is_set():
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            with self._lock:
                registered = not self._done.is_set()
                if registered:
                    self._waiters.append((loop, fut))
            if registered:
                await fut
        self._raise()


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


_STOP = object()


class CPUStream:
    """FIFO worker thread. Work items are callables; events complete in launch order.

    `threads`: torch intra-op threads for work run on this stream (None: torch's setting)."""

    def __init__(self, name: str, busy_hook: Callable[[str, str, float, float], None] | None = None,
                 threads: int | None = None):
        self.name = name
        self.threads = threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.busy_hook = busy_hook  # tracing: (stream, label, start, end), set by the tracer
        self._threads_set = threading.Event()
        before = torch.get_num_threads()
        self._thread = threading.Thread(target=self._run, name=f"slipstream-{name}", daemon=True)
        self._thread.start()
        if threads is not None:
            # torch.set_num_threads on the stream's thread also changes the process default that
            # threads without a setting of their own pick up: restore it once the stream has its own.
            self._threads_set.wait()
            torch.set_num_threads(before)

    def _run(self) -> None:
        import time

        if self.threads is not None:
            torch.get_num_threads()  # torch's lazy per-thread init first, or it would override the setting
            torch.set_num_threads(self.threads)  # this thread's OpenMP team (see __init__)
        self._threads_set.set()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fn, label = item
            if self._error is not None and not isinstance(fn, _EventOp):
                continue  # a failed stream skips work, but still completes events (with the error)
            t0 = time.perf_counter()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - kept and surfaced through events
                self._error = e
            hook = self.busy_hook
            if hook is not None and label:
                hook(self.name, label, t0, time.perf_counter())

    def launch(self, fn: Callable[[], None], label: str = "") -> None:
        self._queue.put((fn, label))

    def record(self) -> CPUEvent:
        ev = CPUEvent()
        self._queue.put((_EventOp(lambda: ev._complete(self._error)), ""))
        return ev

    def wait(self, event: Event) -> None:
        """Later work waits for `event`; an error the event carries becomes this stream's error
        too (a consumer of failed work must not run on its stale outputs)."""
        assert isinstance(event, CPUEvent), "a stream waits only for its own device's events"

        def adopt() -> None:
            event._done.wait()
            if event._error is not None and self._error is None:
                self._error = event._error

        self._queue.put((_EventOp(adopt), ""))

    def clear_error(self) -> None:
        """Resume running launched work after a failure (the loop drained every step first)."""
        self._error = None

    def flush_spans(self) -> None:
        """Nothing to do: the worker thread reports each span as it finishes."""

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=5)


class _EventOp:
    """Marks stream-ordering work that still runs after an error (so waiters are released)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


def default_forward_threads() -> int:
    """One intra-op thread fewer than torch's setting (at least 1): the asyncio loop is the host half
    of the pipeline and needs a core of its own. A decode forward is bound by memory bandwidth, which
    one thread of oneDNN's packed GEMV nearly saturates, and an OpenMP team that spans every core
    stalls at each barrier whenever the loop (or another process) takes one of them: on the 2-core
    development machine 1 thread decoded faster than 2 in every paired run (docs/benchmarks.md,
    "CPU decode vs transformers (issue 18)")."""
    return max(1, torch.get_num_threads() - 1)


class CPUDevice:
    kind = "cpu"
    unified_memory = True  # step inputs and masks are read where the host wrote them: no upload

    def __init__(self, forward_threads: int | None = None) -> None:
        self.torch_device = torch.device("cpu")
        self.forward_threads = forward_threads or default_forward_threads()
        self.compute = CPUStream("compute", threads=self.forward_threads)
        self.copy = CPUStream("copy")
        self.upload = self.copy  # unused while memory is unified; kept so the interface is whole

    def free_memory(self) -> int:
        return 0

    def host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def recover(self) -> bool:
        """Clear the streams' sticky errors; True: the device can run new work."""
        self.compute.clear_error()
        self.copy.clear_error()
        return True

    def close(self) -> None:
        self.compute.close()
        self.copy.close()

"""A CPU device that behaves like a GPU: each stream is a worker thread draining a FIFO queue.

`launch` returns at once and the work runs on the stream's thread; torch ops release the GIL, so
the asyncio loop's bookkeeping really overlaps the forward. Events are one-shot (a fresh event
per record, so no event is ever re-armed while someone waits on it). Errors raised by launched
work are kept and re-raised to whoever next waits on that stream's events, like a sticky CUDA
error, instead of being lost on a worker thread.
"""
from __future__ import annotations

import _thread
import asyncio
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # (device.py makes devices: a runtime import would be a circle)
    from slipstream.runtime.devices.device import Event


class CPUEvent:
    """One-shot: completed once, by the stream thread that reaches it. A lock held from creation to
    completion lets threads block on it (`synchronize`, another stream's `wait`); the asyncio loop
    registers a future instead. No Condition: an event per step is made and completed on the hot
    path, and a lock costs a fraction of threading.Event's notify."""

    __slots__ = ("_done", "_error", "_waiters", "_lock")

    def __init__(self) -> None:
        self._done = False
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._lock = _thread.allocate_lock()
        self._lock.acquire()

    def _complete(self, error: BaseException | None = None) -> None:
        """On the stream's thread. `_done` is written before `_waiters` is read, and wait_async
        appends before it reads `_done` again: (under the GIL's ordering) one of the two sides
        sees the other, so no waiter is missed; both may resolve it (harmless)."""
        self._error = error
        self._done = True
        self._lock.release()
        for loop, fut in self._waiters:
            loop.call_soon_threadsafe(_resolve, fut)

    def query(self) -> bool:
        return self._done

    def synchronize(self) -> None:
        self.synchronize_quietly()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def synchronize_quietly(self) -> None:
        """Block until completed, without raising its error (a stream adopts it instead)."""
        if not self._done:
            self._lock.acquire()
            self._lock.release()

    async def wait_async(self) -> None:
        if not self._done:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append((fut.get_loop(), fut))
            if self._done:  # completed meanwhile: its thread may have read the waiters before
                _resolve(fut)
            await fut
        self._raise()


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


_STOP = object()


class CPUMark:
    """The stream thread's CPU time when it reaches the mark: two marks on one stream give the CPU time
    of the work between them, which, unlike the wall clock, does not grow while other threads or
    processes hold the cores (the development machine is shared; the engine loop shares it too)."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t: float | None = None

    def stamp(self) -> None:
        self.t = time.thread_time()

    def ms_to(self, end: "CPUMark") -> float | None:
        return None if self.t is None or end.t is None else (end.t - self.t) * 1000.0


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
        if self.threads is not None:
            torch.get_num_threads()  # torch's lazy per-thread init first, or it would override the setting
            torch.set_num_threads(self.threads)  # this thread's OpenMP team (see __init__)
        self._threads_set.set()
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            if type(item) is CPUEvent:  # recorded here: everything launched before it has run
                item._complete(self._error)
                continue
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
        self._queue.put(ev)
        return ev

    def mark(self) -> CPUMark:
        mark = CPUMark()
        self._queue.put((mark.stamp, ""))
        return mark

    def wait(self, event: Event) -> None:
        """Later work waits for `event`; an error the event carries becomes this stream's error
        too (a consumer of failed work must not run on its stale outputs)."""
        assert isinstance(event, CPUEvent), "a stream waits only for its own device's events"

        def adopt() -> None:
            event.synchronize_quietly()
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

    def release_memory(self) -> None:
        """Nothing to hand back: host memory is freed as its last reference goes (a cycle, at the
        next collection)."""

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

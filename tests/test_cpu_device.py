"""The emulated CPU device behaves like a GPU: FIFO streams, async launch, cross-stream events."""
import asyncio
import threading
import time

import pytest

from slipstream.runtime.devices.cpu_device import CPUDevice
from slipstream.runtime.devices.make import make_device


@pytest.fixture
def dev():
    d = CPUDevice()
    yield d
    d.close()


def test_launch_returns_at_once_and_runs_in_fifo_order(dev):
    order = []
    gate = threading.Event()
    dev.compute.launch(lambda: (gate.wait(10), order.append(1)))
    dev.compute.launch(lambda: order.append(2))
    assert order == []  # launch did not wait for the work: it cannot run before the gate opens
    ev = dev.compute.record()
    assert not ev.query()
    gate.set()
    ev.synchronize()
    assert order == [1, 2]
    assert ev.query()


def test_a_stream_waits_on_an_event_of_another(dev):
    order = []
    gate = threading.Event()
    dev.compute.launch(lambda: (gate.wait(), order.append("forward")))
    dev.copy.wait(dev.compute.record())
    dev.copy.launch(lambda: order.append("copy"))
    done = dev.copy.record()
    time.sleep(0.02)
    assert order == [] and not done.query()  # the copy is held back by the compute event
    gate.set()
    done.synchronize()
    assert order == ["forward", "copy"]


async def test_the_loop_awaits_an_event_without_blocking(dev):
    dev.compute.launch(lambda: time.sleep(0.1))
    ev = dev.compute.record()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while not ev.query():
            ticks += 1
            await asyncio.sleep(0.005)

    await asyncio.gather(ev.wait_async(), ticker())
    assert ticks >= 5  # the loop kept running other tasks while the event was pending


async def test_errors_in_launched_work_surface_through_events(dev):
    def boom():
        raise ValueError("kernel failed")

    dev.compute.launch(boom)
    dev.compute.launch(lambda: pytest.fail("work after a failure must not run"))
    with pytest.raises(ValueError, match="kernel failed"):
        await dev.compute.record().wait_async()


def test_make_device_rejects_unknown_kinds():
    with pytest.raises(ValueError):
        make_device("tpu")


def test_compute_stream_threads_are_its_own():
    """The forward's intra-op threads are set on the compute stream only: the creating thread and
    threads started later keep torch's process setting (a library must not change it)."""
    import torch

    before = torch.get_num_threads()
    d = CPUDevice(forward_threads=1)
    try:
        seen = {}
        d.compute.launch(lambda: seen.setdefault("compute", torch.get_num_threads()))
        d.copy.launch(lambda: seen.setdefault("copy", torch.get_num_threads()))
        d.compute.record().synchronize()
        d.copy.record().synchronize()
        fresh = []
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == {"compute": 1, "copy": before} and fresh == [before] and torch.get_num_threads() == before
    finally:
        d.close()
    assert make_device("cpu").forward_threads == max(1, before - 1)  # the default leaves the loop a core


async def test_an_event_completed_at_any_point_of_its_await_wakes_the_loop():
    """CPUEvent's two sides share `_done` and `_waiters` without a lock: the stream thread sets done,
    then reads the waiters; the loop appends its waiter, then reads done again. Completing the event
    between any two bytecodes of `wait_async` must still let it return. (Mutant: without the second
    read of `_done`, a completion between the first read and the append hangs the await.)"""
    import sys

    from slipstream.runtime.devices import cpu_device

    k, points = 0, 1
    while k <= points:
        ev, seen = cpu_device.CPUEvent(), [0]

        def local(frame, event, arg):
            if event == "opcode":
                if seen[0] == k:
                    ev._complete()  # what the stream's thread does, here between two bytecodes
                seen[0] += 1
            return local

        def tracer(frame, event, arg):
            if frame.f_code is not cpu_device.CPUEvent.wait_async.__code__:
                return None
            frame.f_trace_opcodes = True
            return local

        sys.settrace(tracer)
        try:
            waiting = asyncio.ensure_future(ev.wait_async())
            await asyncio.sleep(0)
        finally:
            sys.settrace(None)
        if not ev.query():
            ev._complete()  # (k past the await's bytecodes)
        await asyncio.wait_for(waiting, 1.0)
        points = seen[0]
        k += 1
    assert points > 10

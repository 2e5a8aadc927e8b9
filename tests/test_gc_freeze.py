"""Serving leaves no per-request garbage cycles, and the start-time heap is frozen while engines run."""
import asyncio
import gc

import pytest

import slipstream.gc_freeze
from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.api.request_stream import RequestState

async def test_finished_requests_are_freed_without_the_cycle_collector():
    """Only this test's requests are counted (other engines of the session may hold theirs), and
    each may stay referenced a moment after its caller got the result (the output stage lets go at
    its next pass): with the collector off, only refcounting can free them, so one in a cycle
    stays alive and the wait runs out."""
    async with Engine(EngineConfig(model="tiny-random", device="cpu", freeze_gc=False)) as engine:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        await engine.complete("warm up", params)
        gc.collect()
        gc.disable()
        try:
            for i in range(5):
                await engine.complete(f"prompt {i}", params, request_id=f"gc-test-{i}")
                async for _ in engine.stream("streamed", SamplingParams(max_tokens=3, stop=["zz"]),
                                             request_id=f"gc-test-s{i}"):
                    pass
            for _ in range(200):
                alive = [o.request_id for o in gc.get_objects()
                         if type(o) is RequestState and o.request_id.startswith("gc-test-")]
                if not alive:
                    break
                await asyncio.sleep(0.01)
        finally:
            gc.enable()
        assert not alive, f"requests left for the cycle collector: {alive}"


async def test_engines_hold_the_freeze_until_the_last_one_stops(monkeypatch):
    monkeypatch.setattr(slipstream.gc_freeze, "COLLECT_FIRST", True)
    gc.unfreeze()
    a = await Engine(EngineConfig(model="tiny-random", device="cpu")).start()
    try:
        assert gc.get_freeze_count() > 0
        async with Engine(EngineConfig(model="tiny-random", device="cpu")) as b:
            await b.complete("hi", SamplingParams(max_tokens=2))
        assert gc.get_freeze_count() > 0  # a still runs
    finally:
        await a.close()
    assert gc.get_freeze_count() == 0
    async with Engine(EngineConfig(model="tiny-random", device="cpu", freeze_gc=False)):
        assert gc.get_freeze_count() == 0

def test_freeze_gc_is_validated():
    from slipstream.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="freeze_gc"):
        EngineConfig(model="tiny-random", freeze_gc="yes")


async def test_starting_a_running_engine_again_is_refused_and_holds_nothing():
    from slipstream.errors import EngineAlreadyStartedError

    async with Engine(EngineConfig(model="tiny-random", device="cpu")) as engine:
        with pytest.raises(EngineAlreadyStartedError, match="already started"):
            await engine.start()
    assert gc.get_freeze_count() == 0


async def test_a_closed_engine_is_freed_while_another_runs():
    """Issue 27, defect 4: the second engine's start froze everything alive, the first engine too;
    its loop is in reference cycles, so once closed its KV cache stayed until the last engine stopped."""
    import weakref

    gc.unfreeze()
    a = await Engine(EngineConfig(model="tiny-random", device="cpu")).start()
    kv = weakref.ref(a._parts.runner.kv.k)
    await a.complete("hi", SamplingParams(max_tokens=2))
    async with Engine(EngineConfig(model="tiny-random", device="cpu")) as b:
        await a.close()
        del a
        gc.collect()
        freed = kv() is None
        assert freed  # while b runs
        assert (await b.complete("hi", SamplingParams(max_tokens=2))).finish_reason == "length"
        assert gc.get_freeze_count() > 0  # b keeps the start-time heap frozen
    assert gc.get_freeze_count() == 0


async def test_an_application_gc_freeze_survives_an_engine():
    """Issue 27, defect 3: release() called gc.unfreeze(), undoing the application's own freeze
    (pre-fork servers freeze on purpose)."""
    gc.unfreeze()
    kept = [[i] for i in range(20_000)]  # the application's heap
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        async with Engine(EngineConfig(model="tiny-random", device="cpu")) as engine:
            await engine.complete("hi", SamplingParams(max_tokens=2))
            assert gc.get_freeze_count() >= before - 1000  # (frozen objects that die leave the count)
        assert before - 1000 <= gc.get_freeze_count() <= before  # as the application left it
        del kept
    finally:
        gc.unfreeze()


async def test_the_watchdog_holds_no_step_it_looked_at():
    """The watchdog's coroutine kept the last step it inspected as a local across its sleep, and
    through it the step's sequences and requests: after the last step it saw, for good. The cycle
    collector cannot free that, and test_finished_requests_… above failed when the watchdog woke
    during one of its requests (issue 37's full-suite run)."""
    import time
    import weakref
    from types import SimpleNamespace

    from slipstream.scheduler.watchdog import Watchdog

    class Step:
        timings = {"t_launch": time.perf_counter() + 3600}  # never stalled

    step = Step()
    fake = SimpleNamespace(pipeline=SimpleNamespace(inflight=[step]))
    dog = Watchdog(fake, timeout_s=0.02)  # wakes every 5 ms
    task = asyncio.ensure_future(dog.run(asyncio.current_task()))
    try:
        await asyncio.sleep(0.05)  # it has looked at the step
        seen = weakref.ref(step)
        fake.pipeline.inflight.clear()
        del step
        await asyncio.sleep(0.05)
        assert seen() is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

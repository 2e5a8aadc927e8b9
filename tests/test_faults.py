"""Faults inside the tick fail only the requests they touch; nothing stale is ever served.

Injected (slipstream.faults) into a forward, into sampling, into a grammar matcher and into
detokenisation, at depth 1 and 2, on the real CPU device (a forward or a sampling fault surfaces
across the copy stream's wait). Plus the watchdog, the stale-buffer stamp and stream error rules.
"""
import asyncio
import logging

import pytest
import torch

from engine_util import wait_all_free
from invariance import invariant_config
from slipstream import Engine, SamplingParams
from slipstream.errors import (
                               EngineClosedError,
                               GrammarError,
                               PipelineInvariantError,
                               RequestFailedError,
                               StepFailedError,
                               StepTimeoutError,
                               )
from slipstream.faults import FaultInjector, InjectedFault, install
from slipstream.runtime.step.step_slot import LaunchedStep, StepSlot
from slipstream.runtime.devices.cpu_device import CPUDevice


def cfg(depth, **kw):
    base = dict(model="tiny-random", pipeline_depth=depth, max_batch_size=8, max_num_batched_tokens=64,
                kv_cache_tokens=2048, page_size=8)
    base.update(kw)
    return invariant_config(**base)  # survivors' outputs are compared with a clean run's


PROMPTS = [[5 + i, 17, 33 + i, 9] for i in range(6)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


async def clean_outputs(depth):
    async with Engine(cfg(depth)) as engine:
        return [o.token_ids for o in await asyncio.gather(*(engine.complete(p, GREEDY) for p in PROMPTS))]


@pytest.fixture(scope="module")
def reference():
    return asyncio.run(clean_outputs(1))


async def gather_outcomes(engine, prompts, params=GREEDY):
    return await asyncio.gather(*(engine.complete(p, params) for p in prompts), return_exceptions=True)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("point", ["forward", "sample"])
async def test_device_fault_fails_its_step_and_the_engine_goes_on(depth, point, reference):
    async with Engine(cfg(depth)) as engine:
        faults = FaultInjector().arm(point, 1)
        install(engine, faults)
        first = await gather_outcomes(engine, PROMPTS)
        assert faults.fired[point] == 1
        failed = [r for r in first if isinstance(r, BaseException)]
        assert failed, "the faulty step's requests must fail"
        assert all(isinstance(r, StepFailedError) and isinstance(r.__cause__, InjectedFault) for r in failed)
        for got, want in zip(first, reference):  # those that finished are right, never stale
            if not isinstance(got, BaseException):
                assert got.token_ids == want
        # the engine recovered: every request after the fault is served, and served right
        again = await gather_outcomes(engine, PROMPTS)
        assert [o.token_ids for o in again] == reference
        stats = await wait_all_free(engine)
        assert stats["failed_steps"] >= 1


async def test_sampling_fault_never_serves_stale_tokens_on_later_requests(reference):
    """The defect: after a sampler error, every request got the slot's stale tokens with "length"."""
    async with Engine(cfg(2)) as engine:
        install(engine, FaultInjector().arm("sample", 1))
        with pytest.raises(StepFailedError):
            await engine.complete(PROMPTS[0], GREEDY)
        outs = [await engine.complete(p, GREEDY) for p in PROMPTS]
        assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("depth", [1, 2])
async def test_detokenize_fault_fails_only_that_request(depth, reference):
    async with Engine(cfg(depth)) as engine:
        install(engine, FaultInjector().arm("detokenize", 1))
        outcomes = await gather_outcomes(engine, PROMPTS)
        failed = [r for r in outcomes if isinstance(r, BaseException)]
        assert len(failed) == 1 and isinstance(failed[0], RequestFailedError)
        assert not isinstance(failed[0], StepFailedError)
        for got, want in zip(outcomes, reference):
            if not isinstance(got, BaseException):
                assert got.token_ids == want
        await wait_all_free(engine)
        assert [o.token_ids for o in await gather_outcomes(engine, PROMPTS)] == reference


async def test_matcher_fault_fails_only_that_request():
    async with Engine(cfg(2)) as engine:
        install(engine, FaultInjector().arm("matcher", 1))
        constrained = SamplingParams(max_tokens=8, temperature=0.0, regex="[a-z]+")
        outcomes = await asyncio.gather(engine.complete("x", constrained), *(engine.complete(p, GREEDY) for p in PROMPTS),
                                        return_exceptions=True)
        assert isinstance(outcomes[0], GrammarError)
        assert not any(isinstance(r, BaseException) for r in outcomes[1:])
        await wait_all_free(engine)


async def test_cancel_mid_stream_and_slow_consumer_free_pages(reference):
    async with Engine(cfg(2)) as engine:
        async def cancel_after(n):
            got = 0
            async for _ in engine.stream(PROMPTS[0], GREEDY):
                got += 1
                if got == n:
                    break

        async def slow():
            ids = []
            async for d in engine.stream(PROMPTS[1], GREEDY):
                ids += d.token_ids
                await asyncio.sleep(0.01)  # the engine never waits for its consumer
            return ids

        results = await asyncio.gather(cancel_after(2), slow())
        assert results[1] == reference[1]
        await wait_all_free(engine)


async def test_watchdog_fails_a_stalled_step_and_logs_the_state(caplog):
    async with Engine(cfg(2, step_timeout_s=0.2)) as engine:
        install(engine, FaultInjector().stall("forward", 1.0))
        with pytest.raises(StepTimeoutError):
            await asyncio.wait_for(engine.complete(PROMPTS[0], GREEDY), 5)
        with pytest.raises(EngineClosedError) as closed:
            await engine.complete(PROMPTS[1], GREEDY)
        assert isinstance(closed.value.__cause__, StepTimeoutError)
        with pytest.raises(EngineClosedError):
            await engine.stats()
        await asyncio.sleep(1.0)  # let the stalled forward finish before the device closes


async def test_a_dead_loop_fails_every_waiting_request_even_one_still_being_submitted():
    async with Engine(cfg(2)) as engine:
        loop_task = engine._loop_task

        def bug(*args, **kwargs):
            raise RuntimeError("a bug in the tick")

        engine.loop.planner.plan = bug
        tokenize = engine.submitter._prompt_ids

        async def late(prompt, *args, **kwargs):  # it checked the engine before the loop died
            ids = await tokenize(prompt, *args, **kwargs)
            if prompt == PROMPTS[1]:
                await asyncio.wait([loop_task])
            return ids

        engine.submitter._prompt_ids = late
        outcomes = await asyncio.wait_for(gather_outcomes(engine, PROMPTS[:2]), 10)
        assert all(isinstance(r, EngineClosedError) for r in outcomes), outcomes
        assert isinstance(outcomes[0].__cause__, RuntimeError)
        assert engine.loop.planner.num_waiting == 0 or all(s.finished for s in engine.loop.planner.waiting)


def test_stream_wait_carries_the_error_across_streams():
    """A stream waiting on a failed stream's event fails too: its later work is skipped and its
    events raise (the copy must never run on the outputs of failed sampling)."""
    dev = CPUDevice()
    try:
        ran = []

        def boom():
            raise InjectedFault("sampling")

        dev.compute.launch(boom)
        dev.copy.wait(dev.compute.record())
        dev.copy.launch(lambda: ran.append("copy"))
        done = dev.copy.record()
        with pytest.raises(InjectedFault):
            done.synchronize()
        assert ran == []
        assert dev.recover()
        dev.copy.launch(lambda: ran.append("after"))
        dev.copy.record().synchronize()
        assert ran == ["after"]
    finally:
        dev.close()


def test_slot_rejects_tokens_stamped_by_another_step():
    dev = CPUDevice()
    try:
        slot = StepSlot(0, dev, max_samples=4, vocab_size=32, arena=None)
        step = LaunchedStep(7, slot, staged=None)
        slot.acquire(step)
        slot.sampled[:2] = torch.tensor([3, 4])
        slot.stamp.fill_(6)  # sampling of step 7 never ran: the stamp is the previous step's
        slot.host_stamp_and_sampled.copy_(slot.stamp_and_sampled)
        step.copy_done = dev.copy.record()
        step.copy_done.synchronize()
        with pytest.raises(PipelineInvariantError, match="stale"):
            slot.read_host(step, 2, False)
        slot.stamp.fill_(7)
        slot.host_stamp_and_sampled.copy_(slot.stamp_and_sampled)
        assert slot.read_host(step, 2, False)[0] == [3, 4]
    finally:
        dev.close()


def test_fault_injector_rejects_unknown_points():
    with pytest.raises(ValueError):
        FaultInjector({"fowrard": 0.5})
    logging.getLogger(__name__).debug("ok")

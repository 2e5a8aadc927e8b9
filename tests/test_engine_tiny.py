"""The pipelined engine end to end on the tiny random model (real torch forward, CPU device)."""
import asyncio
import math
import random

import numpy as np
import pytest

from engine_util import run_staggered, wait_all_free
from invariance import invariant_config
from slipstream import Engine, EngineConfig, InvalidRequestError, SamplingParams
from slipstream.errors import PipelineInvariantError, SlotReuseError
from slipstream.runtime.batch import SeqWork, pack_step
from slipstream.runtime.step.step_slot import LaunchedStep


def cfg(depth, **kw):
    base = dict(model="tiny-random", pipeline_depth=depth, max_batch_size=16, max_num_batched_tokens=64,
                kv_cache_tokens=4096, page_size=8)
    base.update(kw)
    return invariant_config(**base)  # outputs are compared across depths and batchings


def mixed_requests(n=64, seed=0):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(3, 259) for _ in range(rng.randint(1, 90))]
        params = dict(max_tokens=rng.randint(1, 24), temperature=0.0)
        kind = rng.random()
        if kind < 0.2:
            params["stop_token_ids"] = [rng.randrange(3, 259) for _ in range(8)]
        elif kind < 0.3:
            params["stop"] = ["a", "Z"]
        elif kind < 0.4:
            params.update(temperature=0.9, top_p=0.9, top_k=50, seed=i)
        reqs.append((prompt, SamplingParams(**params), rng.random() * 0.02))
    return reqs


async def run_all(engine, reqs):
    return await run_staggered(engine, reqs)


def summary(outs):
    return [(o.token_ids, o.text, o.finish_reason) for o in outs]


async def test_depth2_equals_depth1_on_64_mixed_requests():
    reqs = mixed_requests()
    results = {}
    for depth in (1, 2):
        async with Engine(cfg(depth)) as engine:
            results[depth] = await run_all(engine, reqs)
            stats = await wait_all_free(engine)
            assert stats["waiting"] == 0
    assert summary(results[2]) == summary(results[1])
    assert {o.finish_reason for o in results[1]} >= {"stop", "length"}


async def test_small_pool_waits_and_preempts_with_identical_outputs():
    reqs = [(p, SamplingParams(max_tokens=20, temperature=0.0), d) for p, _, d in mixed_requests(24, seed=3)]
    async with Engine(cfg(1)) as engine:
        want = await run_all(engine, reqs)
    for depth in (1, 2):
        async with Engine(cfg(depth, kv_cache_tokens=160, max_batch_size=8)) as engine:
            got = await run_all(engine, reqs)
            stats = await wait_all_free(engine)
            assert stats["preemptions"] > 0
        assert summary(got) == summary(want)


async def test_zombie_from_stop_token_is_skipped_and_pages_freed():
    prompt = list(range(40, 60))
    async with Engine(cfg(1)) as engine:
        free_run = await engine.complete(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    stop_at = next(i for i, t in enumerate(free_run.token_ids) if i >= 3 and t not in free_run.token_ids[:i])
    stop_tok = free_run.token_ids[stop_at]
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_tok])
    async with Engine(cfg(2)) as engine:
        out = await engine.complete(prompt, params)
        assert out.token_ids == free_run.token_ids[: stop_at + 1]
        assert out.finish_reason == "stop"
        stats = await wait_all_free(engine)
        assert stats["zombie_commits"] == 1  # the step launched before the stop was seen


async def test_stream_deltas_concatenate_to_final_text():
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=["zz"])
    async with Engine(cfg(2)) as engine:
        final = await engine.complete("hello tiny model", params)
        deltas = [d async for d in engine.stream("hello tiny model", params)]
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert deltas[-1].finish_reason == final.finish_reason


async def test_cancelling_mid_stream_frees_pages():
    async with Engine(cfg(2)) as engine:
        agen = engine.stream([5] * 50, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        n = 0
        async for _ in agen:
            n += 1
            if n == 3:
                break
        await agen.aclose()
        assert (await engine.stats())["running"] == 0
        await wait_all_free(engine)


async def test_cancelling_the_awaiting_task_aborts_and_frees_pages():
    async with Engine(cfg(2)) as engine:
        task = asyncio.create_task(engine.complete([7] * 40, SamplingParams(max_tokens=500, temperature=0.0,
                                                                           ignore_eos=True)))
        while (await engine.stats())["steps"] < 4:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_all_free(engine)


async def test_abort_by_request_id():
    async with Engine(cfg(2)) as engine:
        task = asyncio.create_task(engine.complete([9] * 10, SamplingParams(max_tokens=400, temperature=0.0,
                                                                           ignore_eos=True), request_id="r1"))
        while (await engine.stats())["steps"] < 3:
            await asyncio.sleep(0.005)
        assert await engine.abort("r1")
        out = await task
        assert out.finish_reason == "abort" and len(out.token_ids) < 400
        assert not await engine.abort("r1") and not await engine.abort("nope")
        await wait_all_free(engine)


async def test_seeded_sampling_is_reproducible_across_depths():
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    outs = []
    for depth in (1, 2):
        async with Engine(cfg(depth)) as engine:
            outs.append((await engine.complete([11, 12, 13], params)).token_ids)
    assert outs[0] == outs[1]


@pytest.mark.parametrize("bad", [
    dict(max_tokens=-1), dict(max_tokens=0), dict(temperature=-0.5), dict(temperature=math.nan),
    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-3), dict(stop=[""]),
])
def test_invalid_sampling_params_raise_at_construction(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


async def test_invalid_prompts_raise_before_scheduling():
    async with Engine(cfg(2, max_model_len=64)) as engine:
        with pytest.raises(InvalidRequestError):
            await engine.complete("", SamplingParams())
        with pytest.raises(InvalidRequestError):
            await engine.complete([], SamplingParams())
        with pytest.raises(InvalidRequestError, match="context"):
            await engine.complete([5] * 64, SamplingParams())
        with pytest.raises(InvalidRequestError):
            await engine.complete([10**6], SamplingParams())
        assert (await engine.stats())["steps"] == 0
    with pytest.raises(InvalidRequestError):
        EngineConfig(pipeline_depth=3)


async def test_slot_reuse_guard_fires_when_misused():
    async with Engine(cfg(2)) as engine:
        runner = engine._parts.runner
        works = [SeqWork(row=1, tokens=[5, 6, 7], start_pos=0, sample=True)]
        packed = pack_step(np.zeros(0, np.int64), works, np.array([[1, 0, 1]]), 4)
        step = runner.launch_forward(1000, packed)  # masked: its sampling is launched apart
        with pytest.raises(SlotReuseError):  # its buffers are step 1000's until its commit read them
            step.slot.acquire(LaunchedStep(1001, step.slot, step.staged))
        with pytest.raises(PipelineInvariantError):
            step.slot.read_host(step, 1, False)  # reading before the copy was even enqueued
        runner.launch_forward(1001, packed)  # the other slot
        with pytest.raises(PipelineInvariantError, match="no free StepSlot"):
            runner.launch_forward(1002, packed)
        runner.launch_sampling(step)
        ids, logprobs, *_ = await runner.read_sampled(step)  # frees its slot
        assert len(ids) == 1 and logprobs is None
        with pytest.raises(PipelineInvariantError):
            step.slot.release()


async def test_logprobs_are_returned_per_token():
    async with Engine(cfg(2)) as engine:
        out = await engine.complete([20, 21, 22], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True))
        plain = await engine.complete([20, 21, 22], SamplingParams(max_tokens=6, temperature=0.0))
    assert out.token_ids == plain.token_ids and plain.logprobs is None
    assert len(out.logprobs) == 6 and all(lp <= 0.0 for lp in out.logprobs)


def test_engine_runs_on_uvloop():
    import uvloop

    async def main():
        async with Engine(cfg(2)) as engine:
            return await engine.complete("uv", SamplingParams(max_tokens=5, temperature=0.0))

    out = uvloop.run(main())
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


async def test_the_threaded_output_stage_gives_the_same_outputs():
    """EngineConfig(output_stage="thread"): the text phase (detokenise, stop strings) on a worker
    thread while the loop ticks on; outputs equal the loop stage's (stops, stop strings included)."""
    reqs = mixed_requests(40, seed=5)
    outs = {}
    for stage in ("loop", "thread"):
        async with Engine(cfg(2, output_stage=stage, batch_invariant=True)) as engine:
            outs[stage] = await run_all(engine, reqs)
            await wait_all_free(engine)
    assert summary(outs["thread"]) == summary(outs["loop"])
    assert {o.finish_reason for o in outs["loop"]} >= {"stop", "length"}


async def test_aborting_a_stop_string_request_before_its_first_token_ends_it():
    """A request with stop strings is ended by the output stage; an abort that leaves it no token to
    scan must still deliver its final output (the soak found it waiting until its deadline)."""
    async with Engine(cfg(2)) as engine:
        params = SamplingParams(max_tokens=15, temperature=0.9, stop=["f"])
        task = asyncio.ensure_future(engine.complete([40] * 70, params, request_id="stop-abort"))
        await asyncio.sleep(0)
        assert await engine.abort("stop-abort")
        out = await asyncio.wait_for(task, 10)
        assert out.finish_reason == "abort" and out.token_ids == []
        await wait_all_free(engine)


async def test_eager_steps_are_counted_in_stats_and_metrics():
    # the CPU has no graphs: every step is eager (on CUDA the count stays at 0 in steady serving)
    async with Engine(cfg(2)) as engine:
        await engine.complete(list(range(40, 60)), SamplingParams(max_tokens=6, temperature=0.0))
        stats = await wait_all_free(engine)
        assert stats["eager_steps"] == stats["steps"] > 0
        text = await engine.metrics_text()
        assert f'slipstream_eager_steps_total{{model="tiny-random"}} {float(stats["eager_steps"])}' in text

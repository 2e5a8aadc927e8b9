"""A closed Engine lets go of its runner, KV cache, weights and graphs (issue 48, defect 2).

The caller usually still holds the Engine (`async with Engine(...) as engine` leaves the name
bound), and on a GPU the next Engine sizes its KV cache from the memory this one gave back: on an
H200 the fourth engine of a process refused to start. What is checked here on the CPU: once
closed (and a collection run), nothing reachable from the closed Engine, nor from what a caller
kept of it (its metrics, its tracer, the error of a dead loop), holds those objects.
"""
import asyncio
import gc
import types
import weakref

import pytest
import torch

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.api.offline import LLM
from slipstream.errors import EngineClosedError

CFG = dict(model="tiny-random", max_batch_size=4, max_num_batched_tokens=32, kv_cache_tokens=1024, page_size=8,
           max_model_len=64)
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def device_refs(parts) -> dict[str, weakref.ref]:
    """Weak references to what holds device memory: the runner, the model and each of its
    parameters and buffers, the KV cache's tensors, the loop, the step slots, the device. (Not the
    page pool's bookkeeping, host lists that kept metrics may still read.)"""
    runner = parts.runner
    refs = {"runner": weakref.ref(runner), "model": weakref.ref(runner.model), "kv.k": weakref.ref(runner.kv.k),
            "kv.v": weakref.ref(runner.kv.v), "loop": weakref.ref(parts.loop), "device": weakref.ref(parts.device)}
    refs |= {f"slot{i}": weakref.ref(s) for i, s in enumerate(runner.slots)}
    refs |= {f"model.{n}": weakref.ref(t) for n, t in (*runner.model.named_parameters(),
                                                        *runner.model.named_buffers())}
    return refs


def alive(refs: dict[str, weakref.ref]) -> list[str]:
    gc.collect()
    return [name for name, r in refs.items() if r() is not None]


def _kill_loop(engine) -> None:
    """The loop's next plan raises: the loop task dies and every waiter gets the error."""
    def boom(*args, **kwargs):
        raise RuntimeError("planner exploded")

    engine.parts.loop.planner.plan = boom


@pytest.mark.parametrize("case", ["plain", "traced_thread_stage", "loop_died"])
async def test_a_closed_engine_lets_go_of_its_runner_kv_cache_and_weights(case):
    extra = dict(trace=True, output_stage="thread") if case == "traced_thread_stage" else {}
    engine = Engine(EngineConfig(**CFG, **extra))
    kept: list = []  # what a caller may keep past close
    async with engine:
        await engine.complete("warm", PARAMS)
        refs = device_refs(engine.parts)
        kept += [engine.metrics, engine.metrics.registry, engine.tracer, engine.submitter]
        if case == "loop_died":
            _kill_loop(engine)
            with pytest.raises(EngineClosedError) as died:
                await engine.complete("x", PARAMS)
            kept.append(died.value)  # its traceback runs through the loop's frames
            await asyncio.sleep(0)
    assert alive(refs) == []
    assert engine.parts is None
    if case == "traced_thread_stage":
        assert "slipstream_steps_total" in kept[0].text()  # the metrics kept their series
        assert not any(t.name.startswith("slipstream-output") for t in __import__("threading").enumerate())
    if case == "loop_died":
        assert "planner exploded" in "".join(__import__("traceback").format_exception(kept[-1]))


async def test_close_releases_device_memory_after_every_reference_is_gone():
    """release_memory (on CUDA: collect, then torch.cuda.empty_cache) is the last step of close,
    when the graphs and every reference to the runner are gone; before it, blocks that are still
    referenced would stay in the allocator."""
    from slipstream.runtime.devices.cuda_device import CUDADevice

    seen = []
    async with Engine(EngineConfig(**CFG)) as engine:
        refs = device_refs(engine.parts)
        del refs["device"]  # (release_memory is its method)
        engine.parts.device.release_memory = lambda: seen.append(alive(refs))
    assert seen == [[]]

    emptied = []
    monkey = pytest.MonkeyPatch()
    monkey.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    try:
        CUDADevice.release_memory(types.SimpleNamespace())
    finally:
        monkey.undo()
    assert emptied == [True]


async def test_closing_twice_is_harmless_and_a_closed_engine_says_it_is_closed():
    engine = Engine(EngineConfig(**CFG))
    async with engine:
        pages = (await engine.stats())["kv_pages_total"]
    await engine.close()  # again: nothing to do
    for call in (lambda: engine.complete("x", PARAMS), engine.stats, lambda: engine.abort("r"),
                 lambda: engine.chat([{"role": "user", "content": [{"type": "image", "image": b"x"}]}])):
        with pytest.raises(EngineClosedError, match="engine is closed"):
            await call()
    with pytest.raises(EngineClosedError, match="engine is closed"):
        async for _ in engine.stream("x", PARAMS):
            pass
    for attribute in ("metrics", "tracer"):
        with pytest.raises(EngineClosedError, match="engine is closed"):
            getattr(engine, attribute)
    assert not (await engine.health()).ready
    async with engine:  # started again, it builds new parts
        assert (await engine.stats())["kv_pages_total"] == pages
        assert len((await engine.complete("x", PARAMS)).token_ids) == 4


def test_a_closed_llm_lets_go_of_its_engine_parts():
    llm = LLM(EngineConfig(**CFG))
    llm.generate("warm", PARAMS)
    refs = device_refs(llm.engine.parts)
    llm.close()
    llm.close()
    assert alive(refs) == []
    with pytest.raises(EngineClosedError):
        llm.generate("x", PARAMS)


@pytest.mark.cuda
async def test_ten_engines_in_a_row_on_a_gpu_each_get_the_first_ones_kv_pool():
    """The H200 case: each engine sizes its pool from free memory (kv_cache_tokens unset) with its
    graphs captured, and every closed Engine stays referenced (as `async with ... as engine` leaves
    the name bound). Every pool is the first one's within 2%, the allocator's cache went back to the
    driver at each close, and nothing of a closed engine stays allocated."""
    cfg = EngineConfig(model="random-smollm2-135m", device="cuda", dtype="bfloat16", max_batch_size=4,
                       max_num_batched_tokens=64, page_size=16, graph_token_sizes=(16, 64))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    sizes, cached, left, closed = [], [], [], []
    for _ in range(10):
        engine = Engine(cfg)
        closed.append(engine)
        async with engine:
            await engine.complete("warm", PARAMS)
            sizes.append((await engine.stats())["kv_pages_total"])
        cached.append(torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
        # torch keeps a cuBLAS workspace per stream a matmul ran on, and each engine's streams are
        # new (tests/test_cuda_runtime.py::test_closed_engine_releases_its_device_memory)
        getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
        left.append(torch.cuda.memory_allocated() - before)
    first = sizes[0]
    assert all(abs(s - first) <= 0.02 * first for s in sizes), sizes
    assert max(cached) < 256 * 2**20, [f"{b / 2**20:.1f} MiB" for b in cached]  # reserved, unused, after close
    assert max(left) < 2**20, [f"{b / 2**20:.1f} MiB" for b in left]  # still allocated after each close

"""A failed graph capture poisons nothing (runtime/graphs/graph_record.py), on the CPU: the real capture
code against tests/fake_graph_api.py, which keeps torch's allocator bookkeeping (a capture left
recording to the shared pool makes every later capture into it raise, as on the H100 on
2026-11-27). One capture fails mid-way; that cache runs eagerly, the others capture and replay into
the same pool, and a second to tenth engine start in the same process."""
import asyncio
import contextlib
import gc

import numpy as np
import pytest
import structlog
import torch

from fake_graph_api import FakeGraphApi
from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.runtime.graphs import cuda_graphs, graph_record
from slipstream.runtime.graphs.graph_record import record
from slipstream.runtime.graphs.static_step import StaticStepTensors
from test_mixed_graphs import needs_triton

POOL = (0, 1)  # one pool for every engine (harsher than torch: a leftover recording hits the next engine)
DEV = torch.device("cpu")
FORBIDDEN = "CUDA error: operation not permitted when stream is capturing"


def test_a_capture_failing_mid_way_leaves_stream_allocator_and_pool_as_they_were():
    api = FakeGraphApi()
    kept, _ = record(lambda: torch.ones(2), POOL, "compute", DEV, api)  # a graph alive in the pool

    def invalidated():
        api.forbidden_call()
        raise RuntimeError(FORBIDDEN)

    def invalidated_quietly():  # the error comes from capture_end instead
        api.forbidden_call()
        return torch.ones(2)

    for run in (invalidated, invalidated_quietly):
        with pytest.raises(RuntimeError, match="not permitted"):
            record(run, POOL, "compute", DEV, api)
        assert api.clean and api.refs[POOL] == 1  # only the live graph holds the pool
    graph, out = record(lambda: torch.full((2,), 3.0), POOL, "compute", DEV, api)  # the pool takes captures again
    assert graph.ended and api.refs[POOL] == 2 and gc.isenabled()
    with pytest.raises(ValueError):  # a valid capture whose Python raised: ended cleanly, nothing recorded
        record(lambda: (_ for _ in ()).throw(ValueError("bad shape")), POOL, "compute", DEV, api)
    assert api.clean and kept.ended


def test_no_cycle_collection_runs_inside_a_capture():
    """A dead graph in a reference cycle (a closed engine's) is collected outside captures only:
    its finalizer's cudaGraphExecDestroy would invalidate the capture it lands in."""
    api = FakeGraphApi()
    dead, _ = record(lambda: torch.ones(1), POOL, "compute", DEV, api)
    cycle = [dead]
    cycle.append(cycle)
    del dead, cycle

    def allocating():  # enough container allocations to trigger collections, were they on
        junk = [[i] for i in range(20000)]
        return torch.tensor([len(junk)])

    graph, _ = record(allocating, POOL, "compute", DEV, api)
    assert graph.ended and api.clean
    gc.collect()
    assert api.refs[POOL] == 1  # the dead one went, outside the capture


CFG = dict(model="tiny-random", max_batch_size=4, max_num_batched_tokens=32, kv_cache_tokens=1024, page_size=8,
           graph_batch_sizes=(1, 2, 4), graph_token_sizes=(16, 32))


@pytest.fixture
def fake_cuda(monkeypatch):
    """The real _capture, install_graphs and GraphCache on the CPU device, recording through the fake."""
    api = FakeGraphApi()
    monkeypatch.setattr(graph_record, "API", api)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: POOL)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    return api


async def _start(cfg, fail_mixed=False, only_start=False):
    """An engine with graphs installed the way assemble does on CUDA; `fail_mixed`: every mixed
    capture is invalidated mid-way (what the H100 run's collected graph did); `only_start`: the
    captures record a stand-in forward (no request will run)."""
    engine = await Engine(cfg).start()
    runner, device = engine._parts.runner, engine._parts.device
    device.compute.stream = "compute"  # (what _capture records on)
    runner.model.set_kernel_backend("triton")  # what a graph holds: the device attention (interpreted here)
    if only_start:
        runner.forward.logits = lambda t, *args, **kw: torch.zeros(1)
    if fail_mixed:
        forward = runner.forward.logits

        def failing(t, *args, **kw):
            if isinstance(t, StaticStepTensors) and graph_record.API.capture is not None:
                graph_record.API.forbidden_call()
                raise RuntimeError(FORBIDDEN)
            return forward(t, *args, **kw)

        runner.forward.logits = failing
    cuda_graphs.install_graphs(runner, device, cfg)
    return engine


@needs_triton
def test_a_failed_capture_turns_one_cache_off_and_the_next_engines_start(fake_cuda):
    reqs = [([5 + i, 40, 7, 99 - i, 12][: 3 + i % 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                                     logprobs=i % 2 == 0)) for i in range(3)]

    async def first():
        eager = EngineConfig(**CFG)
        async with Engine(eager) as engine:
            want = await asyncio.gather(*(engine.complete(p, sp) for p, sp in reqs))
        with structlog.testing.capture_logs() as logs:
            engine = await _start(EngineConfig(**CFG, mixed_graphs=True), fail_mixed=True)
        try:
            got = await asyncio.gather(*(engine.complete(p, sp) for p, sp in reqs))
            return want, got, engine._parts.runner, logs
        finally:
            await engine.close()

    want, got, runner, logs = asyncio.run(first())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        if w.logprobs:
            np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
    errors = [e for e in logs if e["log_level"] == "error"]
    assert [(e["event"], e["kind"]) for e in errors] == [("cuda_graph_capture_failed", "mixed")]
    assert "not permitted" in errors[0]["error"] and errors[0]["exc_info"] is True
    assert runner.mixed_graphs.failed and runner.graphs.failed is None and runner.greedy_graphs.failed is None
    replays = sum(runner.graphs.replays.values()) + sum(runner.greedy_graphs.replays.values())
    assert replays > 0 and not runner.mixed_graphs.replays  # decode graphs captured into the same pool after it
    assert fake_cuda.clean and fake_cuda.refs[POOL] == 0  # closed: every graph released, at close

    async def later():
        cfg = EngineConfig(**{**CFG, "graph_batch_sizes": (1, 1, 1)}, pipeline_depth=1, mixed_graphs=False)
        for _ in range(2, 11):
            engine = await _start(cfg, only_start=True)
            runner = engine._parts.runner
            assert runner.graphs.failed is None and len(runner.graphs.graphs) == 1
            await engine.close()
            assert fake_cuda.clean and fake_cuda.refs[POOL] == 0

    asyncio.run(later())


def check_graph_log_fields(warm: list, lazy: list, buckets: list, tokens: list, slots: int) -> None:
    """The warmup and first-use lines of install_graphs (the CUDA test checks the same on a GPU):
    one warmup line per (slot, bucket), mixed first and largest first; each line names its kind and
    the size field of that kind (batch_size, or tokens for mixed), never the other's."""
    size = {"decode": "batch_size", "greedy": "batch_size", "carry": "batch_size", "mixed": "tokens"}
    for e in warm + lazy:
        if e["event"] in ("cuda_graph_warmup", "cuda_graph_captured_on_first_use"):
            field, other = size[e["kind"]], {"batch_size", "tokens"} - {size[e["kind"]]}
            assert field in e and not other & e.keys(), e
    decode = sorted(e["batch_size"] for e in warm if e["event"] == "cuda_graph_warmup" and e["kind"] == "decode")
    assert decode == sorted(buckets * slots)
    mixed = [e["tokens"] for e in warm if e["event"] == "cuda_graph_warmup" and e["kind"] == "mixed"]
    assert mixed == [t for t in sorted(tokens, reverse=True) for _ in range(slots)]
    assert [e["kind"] for e in warm if e["event"] == "cuda_graphs_memory"] == ["mixed", "decode", "greedy"]
    assert "cuda_graph_warmup" not in [e["event"] for e in lazy]
    first = {(e["kind"], e[size[e["kind"]]]) for e in lazy if e["event"] == "cuda_graph_captured_on_first_use"}
    assert {("mixed", min(tokens)), ("decode", 1), ("greedy", 1)} <= first, first


@needs_triton
def test_warmup_and_first_use_log_lines_name_their_kind_and_size(fake_cuda):
    cfg = dict(CFG, graph_batch_sizes=(1, 2, 2), pipeline_depth=1, mixed_graphs=True)

    async def one(warmup):
        with structlog.testing.capture_logs() as logs:
            engine = await _start(EngineConfig(**cfg, warmup=warmup))
            try:
                await engine.complete([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
            finally:
                await engine.close()
        return logs

    warm, lazy = asyncio.run(one(True)), asyncio.run(one(False))
    check_graph_log_fields(warm, lazy, [1, 2], [16, 32], slots=1)

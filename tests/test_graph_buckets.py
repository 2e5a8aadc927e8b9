"""CUDA-graph bookkeeping that needs no GPU: buckets, padding, warmup logs, eager fallback, staging.

The engine test swaps the real capture for an eager "graph" that reads exactly what a captured
graph would read (the slot arena padded to the bucket), so the padding path runs end to end on
the CPU and must give the same tokens as the plain path.
"""
import asyncio

import numpy as np
import pytest
import structlog

from engine_util import wait_all_free
from slipstream import Engine, EngineConfig, InvalidRequestError, SamplingParams
from slipstream.runtime.batch import MAX_CARRY_TOKENS, SamplingRow, SeqWork, pack_step
from slipstream.runtime.graphs.buckets import make_buckets, pick_bucket
from slipstream.runtime.devices.cpu_device import CPUDevice
from slipstream.runtime.graphs.cache import GraphCache
from slipstream.runtime.devices.memory import kv_pages_for_memory
from slipstream.runtime.sampling.sampling_args import NO_CARRY, FloatColumn, IntColumn
from slipstream.runtime.step.staging import Layout, StepArena
from test_engine_tiny import mixed_requests


@pytest.mark.parametrize("args, expected", [
    ((1, 16, 64), [1, 2, 4, 8, 16, 32, 48, 64]),  # the example: ramp-up then every step
    ((2, 32, 64), [2, 4, 8, 16, 32, 64]),  # the seed's example with ramp-up
    ((128, 128, 512), [128, 256, 384, 512]),  # the seed's example without ramp-up
    ((16, 16, 64), [16, 32, 48, 64]),  # min == step: no ramp-up
    ((1, 16, 40), [1, 2, 4, 8, 16, 32, 40]),  # max off the step grid is still a bucket
    ((48, 16, 64), [48, 64]),  # min above step
    ((1, 1, 4), [1, 2, 3, 4]),
    ((8, 8, 8), [8]),
])
def test_bucket_generation(args, expected):
    assert make_buckets(*args) == expected


@pytest.mark.parametrize("args", [(0, 16, 64), (1, 0, 64), (8, 16, 4)])
def test_bad_bucket_ranges_are_rejected(args):
    with pytest.raises(InvalidRequestError):
        make_buckets(*args)


def test_padding_picks_the_smallest_bucket_that_holds_the_batch():
    buckets = make_buckets(1, 16, 64)
    picks = {n: pick_bucket(buckets, n) for n in range(1, 66)}
    assert picks[1] == 1 and picks[3] == 4 and picks[9] == 16 and picks[17] == 32 and picks[33] == 48
    assert picks[64] == 64 and picks[65] is None
    for n, b in picks.items():
        if b is not None:
            assert b >= n and all(c < n for c in buckets if c < b)


def _cache(buckets, slots=2):
    captured = []
    cache = GraphCache(buckets, slots, lambda s, b: captured.append((s, b)) or (s, b), free_memory=lambda: 3 * 1024**3)
    return cache, captured


def test_warmup_captures_every_bucket_of_every_slot_and_logs_each():
    cache, captured = _cache([1, 2, 4, 8])
    with structlog.testing.capture_logs() as logs:
        cache.warmup()
    assert sorted(captured) == [(s, b) for s in range(2) for b in (1, 2, 4, 8)]
    per_bucket = [{k: e[k] for k in ("graph", "graphs", "batch_size", "slot", "free_mem_gib")}
                  for e in logs if e["event"] == "cuda_graph_warmup"]
    assert len(per_bucket) == 8  # one line per (slot, bucket), largest bucket first
    assert per_bucket[0] == {"graph": 1, "graphs": 8, "batch_size": 8, "slot": 0, "free_mem_gib": 3.0}
    assert per_bucket[-1] == {"graph": 8, "graphs": 8, "batch_size": 1, "slot": 1, "free_mem_gib": 3.0}
    assert logs[-1]["event"] == "cuda_graphs_captured"
    assert (logs[-1]["graphs"], logs[-1]["buckets"], logs[-1]["slots"]) == (8, 4, 2)
    with structlog.testing.capture_logs() as logs:  # after warmup: replays, no capture, no log
        assert cache.lookup(1, 3) == (4, (1, 4))
    assert logs == [] and len(captured) == 8


def test_without_warmup_each_bucket_is_captured_once_on_first_use_with_a_log_line():
    cache, captured = _cache([1, 2, 4, 8])
    with structlog.testing.capture_logs() as logs:
        assert cache.lookup(0, 5) == (8, (0, 8))
        assert cache.lookup(0, 7) == (8, (0, 8))
        assert cache.lookup(1, 5) == (8, (1, 8))
    assert captured == [(0, 8), (1, 8)]
    assert [(e["event"], e["batch_size"], e["slot"]) for e in logs] == [
        ("cuda_graph_captured_on_first_use", 8, 0), ("cuda_graph_captured_on_first_use", 8, 1)]


def test_oversize_batch_falls_back_to_eager_and_warns_once():
    cache, captured = _cache([1, 2, 4])
    with structlog.testing.capture_logs() as logs:
        assert cache.lookup(0, 5) is None
        assert cache.lookup(1, 9) is None
    assert captured == [] and cache.eager_steps == 2
    assert len(logs) == 1 and logs[0]["log_level"] == "warning" and logs[0]["event"] == "decode_batch_above_graph_buckets"


def test_arena_pads_a_decode_step_to_its_bucket_with_the_scratch_row():
    dev = CPUDevice()
    try:
        arena = StepArena(dev, max_tokens=16, max_seqs=8, max_pages=4)
        packed = pack_step(np.array([3, 5]), [], np.array([[3, 1, 9], [5, 0, 11]]))
        lay = arena.fill(packed, pad_decode=4)
        assert lay == Layout(d=4, tc=0, c=0, n=4, n_pad=4, w=2, max_q_len=1, pad_rows=2)
        t, u = arena.tensors(lay), arena.updates(lay)
        assert t.decode_rows.tolist() == [3, 5, 0, 0]  # padding rows are row 0: page row all scratch
        assert t.query_start.tolist() == [0, 1, 2, 3, 4] and t.sample_indices.tolist() == [0, 1, 2, 3]
        assert t.sample_rows.tolist() == [3, 5, 0, 0] and t.chunk_ids.numel() == 0
        assert u.page_writes.tolist() == [[3, 1, 9], [5, 0, 11]] and u.param_rows.numel() == 0
        with pytest.raises(ValueError, match="exceeds the staging layout"):
            arena.fill(packed, pad_decode=9)
    finally:
        dev.close()


def test_arena_stages_chunks_after_the_decode_rows():
    dev = CPUDevice()
    try:
        arena = StepArena(dev, max_tokens=16, max_seqs=8, max_pages=4)
        chunks = [SeqWork(row=2, tokens=[7, 8, 9], start_pos=0, sample=True, output_index=0,
                          sampling=SamplingRow(temperature=0.5, top_k=3, seed=11)),
                  SeqWork(row=4, tokens=[5, 6], start_pos=4, sample=False)]
        packed = pack_step(np.array([6]), chunks, None, row_multiple=4)
        lay = arena.fill(packed)
        t, u = arena.tensors(lay), arena.updates(lay)
        assert t.decode_rows.tolist() == [6] and t.chunk_ids.tolist() == [7, 8, 9, 5, 6, 0, 0]  # padded to 8 tokens
        assert t.chunk_pos.tolist() == [0, 1, 2, 4, 5, 0, 0] and t.chunk_token_rows.tolist() == [2, 2, 2, 4, 4, 0, 0]
        assert t.query_start.tolist() == [0, 1, 4, 6] and t.chunk_ends.tolist() == [3, 6]
        assert t.sample_indices.tolist() == [0, 3, 0, 0] and t.sample_rows.tolist() == [6, 2]  # (padded to 4)
        assert u.param_rows.tolist() == [2, 4]
        ints, floats = u.params_int[:, 0], u.params_float[:, 0]
        assert (ints[IntColumn.TOP_K], ints[IntColumn.SEED], ints[IntColumn.OUTPUT_INDEX]) == (3, 11, 0)
        assert ints[IntColumn.CARRY:IntColumn.CARRY + MAX_CARRY_TOKENS].tolist() == [NO_CARRY] * MAX_CARRY_TOKENS
        assert (floats[FloatColumn.TEMPERATURE], floats[FloatColumn.TOP_P], floats[FloatColumn.REPETITION_PENALTY],
                floats[FloatColumn.MIN_P]) == (0.5, 1.0, 1.0, 0.0)
    finally:
        dev.close()


def test_kv_pages_from_memory():
    assert kv_pages_for_memory(10 * 1024**3, 0.5, 1024**2, min_pages=4) == 5120
    with pytest.raises(InvalidRequestError, match="gpu_memory_utilization"):
        kv_pages_for_memory(10 * 1024**2, 0.5, 1024**2, min_pages=8)


def test_cuda_knobs_are_validated():
    with pytest.raises(InvalidRequestError):
        EngineConfig(gpu_memory_utilization=0.0)
    with pytest.raises(InvalidRequestError):
        EngineConfig(event_wait="spin")
    with pytest.raises(InvalidRequestError):
        EngineConfig(max_batch_size=16, graph_batch_sizes=(1, 16, 64))
    assert EngineConfig(max_batch_size=64).buckets() == (1, 16, 64)
    assert make_buckets(*EngineConfig(max_batch_size=8).buckets()) == [1, 2, 4, 8]


# --- the padded path end to end, with eager stand-ins for captured graphs ----------------------


class EagerGraph:
    """Replays like a captured graph: fixed bucket shapes read from the slot arena, padding included."""

    def __init__(self, runner, slot, bucket, log):
        self.runner, self.arena, self.bucket, self.log = runner, runner.slots[slot].arena, bucket, log
        self.slot = runner.slots[slot]

    def replay(self):
        tensors = self.arena.tensors(Layout.decode_bucket(self.bucket))
        kv = (self.runner.rows.pos[tensors.decode_rows] + 1).tolist()  # what the forward will see
        self.log.append((self.bucket, self.slot.owner.num_samples, kv))
        return self.runner.forward.logits(tensors, host_attention=True)


async def _run(graphs: bool, reqs):
    cfg = EngineConfig(model="tiny-random", pipeline_depth=2, max_batch_size=8, max_num_batched_tokens=64,
                       kv_cache_tokens=4096, page_size=8, batch_invariant=False)
    async with Engine(cfg) as engine:
        replays = []
        if graphs:
            runner = engine._parts.runner
            runner.graphs = GraphCache(make_buckets(1, 4, 6), 2, lambda s, b: EagerGraph(runner, s, b, replays))
        outs = await asyncio.gather(*(engine.complete(p, sp) for p, sp, _ in reqs))
        await wait_all_free(engine)
        return [o.token_ids for o in outs], replays, runner.graphs if graphs else None


def test_padded_graph_path_gives_the_same_tokens_and_never_returns_padding():
    reqs = [(p, SamplingParams(max_tokens=sp.max_tokens + 4, temperature=0.0, ignore_eos=True), d)
            for p, sp, d in mixed_requests(n=12, seed=3)]
    plain, _, _ = asyncio.run(_run(False, reqs))
    padded, replays, cache = asyncio.run(_run(True, reqs))
    assert padded == plain
    assert [len(t) for t in padded] == [r[1].max_tokens for r in reqs]
    assert len(replays) > 10 and len({b for b, _, _ in replays}) > 1
    for b, n, kv in replays:  # the smallest bucket holding the batch; padding rows see one scratch key
        assert b == pick_bucket([1, 2, 4, 6], n)
        assert all(x > 1 for x in kv[:n]) and kv[n:] == [1] * (b - n)
    assert cache.eager_steps > 0  # 7 or 8 running decodes exceed the largest bucket (6): eager


def test_device_metadata_path_with_the_triton_kernel_matches_the_reference():
    """The GPU forward on the CPU: Triton attention (interpreted) reading only the staged device
    metadata, eagerly and through bucket-padded stand-in graphs that get no host metadata at all —
    what a captured graph computes. Tokens equal the reference attention's."""
    pytest.importorskip("triton")

    async def run(backend: str, graphs: bool):
        cfg = EngineConfig(model="tiny-random", max_batch_size=8, max_num_batched_tokens=64, kv_cache_tokens=2048,
                           page_size=8, batch_invariant=False)
        async with Engine(cfg) as engine:
            runner = engine._parts.runner
            runner.model.set_kernel_backend(backend)
            replays = []
            if graphs:
                def capture(slot, b):
                    arena = runner.slots[slot].arena
                    return type("Replay", (), {"replay": lambda self: replays.append(b) or
                                               runner.forward.logits(arena.tensors(Layout.decode_bucket(b)))})()

                runner.graphs = GraphCache(make_buckets(1, 2, 8), 2, capture)
            params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
            outs = await asyncio.gather(*(engine.complete([5 + i, 9, 11, 40 + i] * (1 + i % 4), params)
                                          for i in range(6)))
            return [o.token_ids for o in outs], replays

    reference, _ = asyncio.run(run("reference", False))
    eager, _ = asyncio.run(run("triton", False))
    padded, replays = asyncio.run(run("triton", True))
    assert eager == reference and padded == reference
    assert replays and set(replays) <= {1, 2, 4, 6, 8}

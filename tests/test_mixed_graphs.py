"""Graphs of mixed and prefill steps, without a GPU: the fixed-shape layout of a token bucket
(slipstream/runtime/graphs/static_step.py) run through ModelRunner with the Triton kernels interpreted.

The stand-in "graph" is captured once per (slot, token bucket): it keeps the bucket's device views
and replays by running the forward on them again. That is exactly what a CUDA graph relies on:
nothing of a step may be baked into the capture except its bucket, so refilling the arena with
another step of the same bucket must give that step's answer. tests/test_mixed_graphs_cuda.py
captures real graphs of the same steps.
"""
import asyncio

import numpy as np
import pytest
import structlog
import torch

from slipstream import Engine, EngineConfig, InvalidRequestError, SamplingParams
from slipstream.errors import PipelineInvariantError
from slipstream.models.loading.build import build_model
from slipstream.models.base import KVCache
from slipstream.runtime.batch import SamplingRow, SeqWork, pack_step
from slipstream.runtime.graphs.buckets import token_buckets
from slipstream.runtime.devices.cpu_device import CPUDevice
from slipstream.runtime.sampling.sampling_launch import SamplingLauncher
from slipstream.runtime.graphs.cache import MIXED, GraphCache
from slipstream.runtime.model_runner import ModelRunner
from slipstream.runtime.step.staging import StepArena
from slipstream.runtime.graphs.static_step import fill_static, static_tensors

try:
    import triton  # noqa: F401
except ImportError:
    triton = None
needs_triton = pytest.mark.skipif(triton is None, reason="needs triton (its interpreter runs the GPU kernels here)")


# --- buckets, the cache, the config ----------------------------------------------------------


@pytest.mark.parametrize("args, expected", [
    ((16, 512), [16, 32, 64, 128, 256, 512]),
    ((16, 600), [16, 32, 64, 128, 256, 512, 600]),  # max off the power-of-two ladder is still a bucket
    ((16, 16), [16]),
    ((1, 5), [1, 2, 4, 5]),
])
def test_token_buckets(args, expected):
    assert token_buckets(*args) == expected


@pytest.mark.parametrize("args", [(0, 16), (32, 16)])
def test_bad_token_bucket_ranges_are_rejected(args):
    with pytest.raises(InvalidRequestError):
        token_buckets(*args)


def test_mixed_graph_cache_logs_by_tokens_captures_on_first_use_and_falls_back_above_the_top():
    captured = []
    cache = GraphCache(token_buckets(16, 64), 2, lambda s, t: captured.append((s, t)) or (s, t), kind=MIXED)
    with structlog.testing.capture_logs() as logs:
        assert cache.lookup(0, 17) == (32, (0, 32))
        assert cache.lookup(0, 32) == (32, (0, 32))
        assert cache.lookup(1, 3) == (16, (1, 16))
        assert cache.lookup(1, 65) is None and cache.lookup(0, 900) is None
    assert captured == [(0, 32), (1, 16)] and cache.eager_steps == 2
    assert [(e["event"], e["kind"], e["tokens"], e.get("slot")) for e in logs] == [
        ("cuda_graph_captured_on_first_use", "mixed", 32, 0), ("cuda_graph_captured_on_first_use", "mixed", 16, 1),
        ("mixed_step_above_graph_buckets", "mixed", 65, None)]
    assert all("seconds" in e for e in logs[:2]) and logs[2]["log_level"] == "warning"
    with structlog.testing.capture_logs() as logs:
        cache.warmup()
    assert sorted(captured) == sorted([(0, 32), (1, 16)] + [(0, 16), (0, 64), (1, 32), (1, 64)])
    assert [e["tokens"] for e in logs if e["event"] == "cuda_graph_warmup"] == [64, 64, 32, 32, 16, 16]
    assert logs[-1]["event"] == "cuda_graphs_captured" and logs[-1]["kind"] == "mixed"


def test_mixed_graph_knobs_are_validated():
    assert EngineConfig(max_num_batched_tokens=512).token_bucket_range() == (16, 512)
    assert EngineConfig(max_batch_size=8, max_num_batched_tokens=8).token_bucket_range() == (8, 8)
    assert EngineConfig(graph_token_sizes=[32, 256]).token_bucket_range() == (32, 256)
    for bad in [(0, 64), (64, 32), (16, 1024), (16,), "16-64", (16.0, 64)]:
        with pytest.raises(InvalidRequestError) as err:
            EngineConfig(graph_token_sizes=bad)
        assert err.value.param.startswith("graph_token_sizes")
    with pytest.raises(InvalidRequestError):
        EngineConfig(mixed_graphs="yes")


# --- the fixed-shape layout --------------------------------------------------------------------


def test_static_layout_pads_tokens_sequences_and_samples_to_the_bucket():
    dev = CPUDevice()
    try:
        arena = StepArena(dev, max_tokens=64, max_seqs=6, max_pages=4)
        packed = pack_step(np.array([3, 5]), [SeqWork(row=2, tokens=[7, 8, 9], start_pos=4, sample=True),
                                              SeqWork(row=4, tokens=[6] * 17, start_pos=0, sample=False)])
        arena.fill(packed)
        fill_static(arena, packed, 32)
        t = static_tensors(arena, 32)
        assert t.token_ids.tolist() == [0, 0, 7, 8, 9] + [6] * 17 + [0] * 10
        assert t.token_pos.tolist() == [0, 0, 4, 5, 6] + list(range(17)) + [0] * 10
        assert t.token_rows.tolist() == [3, 5, 2, 2, 2] + [4] * 17 + [0] * 10  # padding: scratch row
        assert t.token_fed.tolist() == [1, 1] + [0] * 30
        assert t.seq_rows.tolist() == [3, 5, 2, 4, 0, 0] and t.seq_fed.tolist() == [1, 1, 0, 0, 0, 0]
        assert t.seq_ends.tolist() == [0, 0, 7, 17, 0, 0]
        assert t.query_start.tolist() == [0, 1, 2, 5, 22, 22, 22]  # padding sequences: q_len 0
        assert t.sample_indices.tolist() == [0, 1, 4, 0, 0, 0]  # min(T, S) rows; the tail is never sampled
        assert t.blocks.shape == (2, 32 // 16 + 6)
        assert t.blocks[0].tolist()[:5] == [0, 1, 2, 3, 3] and t.blocks[1].tolist()[:5] == [0, 0, 0, 0, 16]
        assert (t.blocks[1, 5:] >= 1 << 30).all()
        small = pack_step(np.array([1]), [])
        arena.fill(small)
        fill_static(arena, small, 32)  # a smaller step in the same bucket rewrites every entry
        assert t.token_ids.tolist() == [0] * 32 and t.token_rows.tolist() == [1] + [0] * 31
        assert t.query_start.tolist() == [0] + [1] * 6 and t.seq_ends.tolist() == [0] * 6
        with pytest.raises(ValueError, match="does not fit"):
            fill_static(arena, packed, 16)
    finally:
        dev.close()


class _SeparateMemory:
    """A device whose arena has distinct host and device tensors (as on CUDA), streams run at once."""

    unified_memory, torch_device = False, torch.device("cpu")

    class _Stream:
        def launch(self, fn, label=""):
            fn()

        def record(self):
            return None

        def wait(self, event):
            pass

    upload = compute = _Stream()

    def host_buffer(self, shape, dtype):
        return torch.zeros(shape, dtype=dtype)


def test_upload_carries_the_static_regions_only_for_a_static_step():
    arena = StepArena(_SeparateMemory(), max_tokens=64, max_seqs=6, max_pages=4)
    packed = pack_step(np.array([3]), [SeqWork(row=2, tokens=[7, 8, 9], start_pos=4, sample=True)])
    arena.fill(packed)
    fill_static(arena, packed, 16)
    arena.upload()
    t = static_tensors(arena, 16)
    assert t.token_ids.tolist() == [0, 7, 8, 9] + [0] * 12 and t.query_start.tolist() == [0, 1, 4, 4, 4, 4, 4]
    assert t.blocks[:, :2].tolist() == [[0, 1], [0, 0]]
    arena.fill(pack_step(np.array([5]), []))  # a decode step: its upload leaves the static regions alone
    arena.host_region("s_token_ids", 16)[:] = 42
    arena.upload()
    assert t.token_ids.tolist() == [0, 7, 8, 9] + [0] * 12


# --- static steps through the runner, Triton kernels interpreted --------------------------------

PAGE, PAGES_PER_ROW = 8, 6
PROMPTS = {r: [(7 * r + 3 * i) % 500 + 3 for i in range(n)] for r, n in {1: 10, 2: 30, 3: 5, 4: 30, 5: 12, 6: 20}.items()}


def _chunk(row, lo, hi, sample):
    return SeqWork(row=row, tokens=PROMPTS[row][lo:hi], start_pos=lo, sample=sample, output_index=0,
                   sampling=SamplingRow(temperature=0.1 * row, top_k=row, seed=100 + row))


def _pages(*rows):
    return np.array([[r, i, 1 + PAGES_PER_ROW * (r - 1) + i] for r in rows for i in range(PAGES_PER_ROW)])


# (decode rows, chunks, new rows): slots alternate 0, 1, 0, ...; buckets (16, 32) below
STEPS = [
    ([], [_chunk(1, 0, 10, True), _chunk(2, 0, 20, False), _chunk(3, 0, 5, True)], (1, 2, 3)),  # 35 tokens: eager
    ([1, 3], [_chunk(2, 20, 30, True), _chunk(4, 0, 17, False)], (4,)),  # 29 -> (slot 1, 32)
    ([1, 2, 3], [_chunk(4, 17, 30, True), _chunk(5, 0, 8, False)], (5,)),  # 24 -> (slot 0, 32)
    ([1, 2, 3, 4], [_chunk(5, 8, 12, True)], ()),  # 8 -> (slot 1, 16)
    ([1, 2, 3, 4, 5], [], ()),  # decode only: eager (no decode graphs here)
    ([1, 2, 3, 4, 5], [_chunk(6, 0, 20, True)], (6,)),  # 25 -> (slot 1, 32) again, another step
]


class ReplayAgain:
    """A stand-in graph: the bucket's device views, fixed at capture; replay = run the forward again."""

    def __init__(self, runner, slot, tokens, log):
        self.runner, self.tokens, self.log, self.slot = runner, tokens, log, slot
        self.tensors = static_tensors(runner.slots[slot].arena, tokens)

    def replay(self):
        self.log.append((self.slot, self.tokens))
        return self.runner.forward.logits(self.tensors)


def _runner(dev):
    model, _, cfg = build_model("tiny-random", "float32", torch.device("cpu"), seed=0)  # its own modules
    model.set_kernel_backend("triton")
    kv = KVCache(cfg, num_pages=1 + PAGES_PER_ROW * 6, page_size=PAGE, dtype=torch.float32, device=torch.device("cpu"))
    kv.k.zero_()
    kv.v.zero_()
    return ModelRunner(model, kv, dev, max_rows=8, max_tokens=64, max_pages=PAGES_PER_ROW)


def _run(runner, steps, hidden_states=True):
    """Logits and final hidden states (the lm_head's input; None without `hidden_states`, e.g. under
    graph replay, which runs no Python hook) of each step's sampled rows."""
    logits, hidden = [], []
    if hidden_states:  # the lm_head's input (the triton forward fuses the final norm: no module hook)
        logits_of = runner.model.logits
        runner.model.logits = lambda x: hidden.append(x) or logits_of(x)
    for i, (decode, chunks, new_rows) in enumerate(steps):
        packed = pack_step(np.array(decode, np.int64), chunks, _pages(*new_rows) if new_rows else None)
        step = runner.launch_forward(i, packed)
        slot = step.slot
        runner.device.compute.record().synchronize()
        n = packed.num_samples
        got = step.logits[:n].clone()
        logits.append((got, hidden[-1][:n].clone() if hidden_states else None))
        # stands in for sampling: the same tokens in every run, so runs compare step by step even
        # where near-ties could sample differently (bfloat16 on a GPU)
        sampled = torch.from_numpy((packed.sample_rows * 7 + i) % 500 + 3).to(runner.rows.last_token.device)
        runner.rows.last_token[sampled.new_tensor(packed.sample_rows)] = sampled
        runner.device.compute.record().synchronize()
        slot.release()
    return logits


def _tables(runner):
    r = runner.rows
    return {"pos": r.pos, "pages": r.pages, "last_token": r.last_token, "params_int": r.sampling.ints,
            "params_float": r.sampling.floats}


@needs_triton
def test_static_mixed_steps_equal_the_eager_steps_and_leave_the_same_row_tables():
    dev_e, dev_g = CPUDevice(), CPUDevice()
    try:
        eager, graphed = _runner(dev_e), _runner(dev_g)
        replays = []
        graphed.mixed_graphs = GraphCache(token_buckets(16, 32), 2, lambda s, t: ReplayAgain(graphed, s, t, replays),
                                          kind=MIXED)
        with structlog.testing.capture_logs() as logs:
            want = _run(eager, STEPS)
            got = _run(graphed, STEPS)
        assert replays == [(1, 32), (0, 32), (1, 16), (1, 32)]  # the last reuses step 2's capture
        assert graphed.mixed_graphs.eager_steps == 1
        assert [(e["event"], e.get("tokens")) for e in logs if e["event"] != "cuda_graph_captured_on_first_use"] \
            == [("mixed_step_above_graph_buckets", 35)]
        for i, ((w, wh), (g, gh)) in enumerate(zip(want, got)):
            assert torch.equal(wh, gh), f"step {i}: final hidden states of the sampled rows"
            # the lm_head multiplies N >= n rows: a CPU (or cuBLAS) kernel for another row count may
            # round differently, so logits are equal up to that (bitwise whenever the kernels match)
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
        te, tg = _tables(eager), _tables(graphed)
        for name in te:
            assert torch.equal(te[name], tg[name]), name
        used = slice(PAGE, None)  # every real page; the scratch page (0) took the padding's writes
        assert torch.equal(eager.kv.k[:, used], graphed.kv.k[:, used])
        assert torch.equal(eager.kv.v[:, used], graphed.kv.v[:, used])
        assert graphed.rows.pos[0] == 0 and (graphed.rows.pages[0] == 0).all()  # scratch row untouched
    finally:
        dev_e.close()
        dev_g.close()


@needs_triton
def test_engine_with_stand_in_graphs_of_both_kinds_gives_the_eager_tokens(monkeypatch):
    """Through the whole engine (depth 2, both slots) with the CUDA wiring (cuda_graphs.install_graphs:
    both caches, warmup, each capture staging an all-padding step of its bucket) and only the capture
    itself replaced by a stand-in replaying the staged views: prefill and mixed steps of up to 32
    tokens replay a mixed stand-in, decode steps a decode stand-in, a larger step runs eagerly, and
    the tokens equal the eager engine's."""
    from slipstream.runtime.graphs import cuda_graphs

    replays = []

    def stand_in(runner, device, pool, stage, forward=None):
        tensors = stage()
        kind = "mixed" if hasattr(tensors, "blocks") else "decode" if forward is None else "greedy"
        forward = runner.forward.logits if forward is None else forward

        class Replay:
            def replay(self):
                replays.append(kind)
                return forward(tensors)

        return Replay()

    monkeypatch.setattr(cuda_graphs, "_capture", stand_in)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    prompts = [[(5 + 7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([20, 20, 20, 8, 4, 6])]
    params = [SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    params[1] = SamplingParams(max_tokens=6, repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True)
    params[2] = SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=5, logprobs=True, ignore_eos=True)

    async def run(graphs: bool):
        cfg = EngineConfig(model="tiny-random", max_batch_size=4, max_num_batched_tokens=48, kv_cache_tokens=1024,
                           page_size=8, batch_invariant=False, graph_token_sizes=(16, 32))
        async with Engine(cfg) as engine:
            runner = engine._parts.runner
            runner.model.set_kernel_backend("triton")
            if graphs:
                with structlog.testing.capture_logs() as logs:
                    cuda_graphs.install_graphs(runner, engine._parts.device, cfg)
                warm = [(e["kind"], e.get("tokens", e.get("batch_size"))) for e in logs
                        if e["event"] == "cuda_graph_warmup"]
                assert warm == [("mixed", 32)] * 2 + [("mixed", 16)] * 2 + [
                    (kind, b) for kind in ("decode", "greedy") for b in (4, 4, 2, 2, 1, 1)]
            sample_group, greedy = SamplingLauncher._sample_group, ModelRunner._launch_greedy
            monkeypatch.setattr(SamplingLauncher, "_sample_group", lambda *a: staged.append(1) or sample_group(*a))
            monkeypatch.setattr(ModelRunner, "_launch_greedy", lambda self, step: staged.append(
                not step.staged.sampled_in_graph) or greedy(self, step))  # (an argmax behind an eager forward)
            outs = await asyncio.gather(*(engine.complete(p, sp) for p, sp in zip(prompts, params)))
            monkeypatch.setattr(SamplingLauncher, "_sample_group", sample_group)
            monkeypatch.setattr(ModelRunner, "_launch_greedy", greedy)
            return [(o.token_ids, o.logprobs) for o in outs], runner.mixed_graphs, engine.loop.num_steps

    staged = []
    eager, _, _ = asyncio.run(run(False))
    staged.clear()
    graphed, cache, steps = asyncio.run(run(True))
    assert [t for t, _ in graphed] == [t for t, _ in eager]
    for (_, got), (_, want) in zip(graphed, eager):  # the lm_head ran on more rows: last-bit rounding
        assert (got is None) == (want is None) and (got is None or np.allclose(got, want, rtol=0, atol=1e-5))
    # decode steps with the penalised or the seeded random row sample eagerly; the rest in the graph
    assert replays.count("mixed") >= 3 and replays.count("decode") >= 3 and replays.count("greedy") >= 3
    assert sum(staged) == steps - replays.count("greedy")  # a greedy-graph step samples nothing after it
    assert cache.eager_steps > 0  # the 48-token first step is above the largest bucket


@needs_triton
def test_a_failed_mixed_capture_leaves_eager_prefill_and_the_decode_graphs(monkeypatch):
    from slipstream.runtime.graphs import cuda_graphs

    def stand_in(runner, device, pool, stage, forward=None):
        tensors = stage()
        if hasattr(tensors, "blocks"):
            raise RuntimeError("operation not permitted when stream is capturing")
        return object()

    monkeypatch.setattr(cuda_graphs, "_capture", stand_in)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    async def run():
        cfg = EngineConfig(model="tiny-random", max_batch_size=4, max_num_batched_tokens=48, kv_cache_tokens=1024,
                           page_size=8, batch_invariant=False, graph_token_sizes=(16, 32))
        async with Engine(cfg) as engine:
            runner = engine._parts.runner
            with structlog.testing.capture_logs() as logs:
                cuda_graphs.install_graphs(runner, engine._parts.device, cfg)
            counts = [len(c.graphs) for c in (runner.mixed_graphs, runner.graphs, runner.greedy_graphs)]
            return runner, logs, counts  # (counted before close, which releases every graph)

    runner, logs, counts = asyncio.run(run())
    assert runner.mixed_graphs.failed and counts == [0, 2 * 3, 2 * 3]  # decode, greedy: 2 slots × buckets 1, 2, 4
    assert runner.graphs.failed is None and runner.greedy_graphs.failed is None
    errors = [e for e in logs if e.get("log_level") == "error"]
    assert [(e["event"], e["kind"]) for e in errors] == [("cuda_graph_capture_failed", "mixed")]
    assert "operation not permitted" in errors[0]["error"] and errors[0]["exc_info"]


@needs_triton
def test_a_mixed_capture_failing_on_first_use_leaves_the_step_eager():
    dev = CPUDevice()
    try:
        runner = _runner(dev)

        def capture(slot, tokens):
            raise RuntimeError("operation not permitted when stream is capturing")

        runner.mixed_graphs = GraphCache(token_buckets(16, 32), 2, capture, kind=MIXED)
        with structlog.testing.capture_logs() as logs:
            got = _run(runner, STEPS[:2], hidden_states=False)
        assert runner.mixed_graphs.failed and len(got) == 2
        assert runner.mixed_graphs.lookup(0, 16) is None  # off for good: no second try, no second line
        assert [e["event"] for e in logs if e["log_level"] == "error"] == ["cuda_graph_capture_failed"]
    finally:
        dev.close()


@needs_triton
def test_a_graph_replay_while_the_other_slot_is_unsampled_is_refused():
    """Graphs share a memory pool: a replay may overwrite the other slot's logits, so the other
    slot's sampling must already be enqueued (the engine loop always does; a caller that does not
    gets an error, not corrupted tokens)."""
    dev = CPUDevice()
    try:
        runner = _runner(dev)
        runner.mixed_graphs = GraphCache(token_buckets(16, 32), 2, lambda s, t: ReplayAgain(runner, s, t, []),
                                         kind=MIXED)
        runner.launch_forward(0, pack_step(np.array([], np.int64), [_chunk(1, 0, 10, True)], _pages(1)))
        with pytest.raises(PipelineInvariantError, match="sampling is not launched"):
            runner.launch_forward(1, pack_step(np.array([], np.int64), [_chunk(2, 0, 20, True)], _pages(2)))
        runner.device.compute.record().synchronize()
    finally:
        dev.close()

"""CPU analogues of the graph paths of tests/test_cuda_paths.py: the CPU engine with decode graphs
installed through the real install_graphs, each capture replaced by a stand-in that replays the
forward on the views it staged at capture and writes its output into ONE buffer shared by every
graph of both slots (harsher than the real shared pool, where only intermediates overlap): any read
of a step's logits after another step's replay would get that step's logits. Each run compares with
the eager engine (no graphs). The Triton kernels run under their interpreter."""
import asyncio

import numpy as np
import pytest
import torch

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.grammar import GrammarSpec, register_grammar, unregister_grammar
from slipstream.runtime.graphs import cuda_graphs
from test_cuda_paths import PROMPTS, _Alternating, record_launches, tokens
from test_mixed_graphs import needs_triton

CFG = dict(model="tiny-random", max_batch_size=6, max_num_batched_tokens=64, kv_cache_tokens=2048, page_size=8,
           mixed_graphs=False, graph_batch_sizes=(1, 2, 6))
SHORT = [p[:5] for p in PROMPTS[:6]]


@pytest.fixture
def shared_pool_graphs(monkeypatch):
    pool = {}

    def stand_in(runner, device, pool_handle, stage, forward=None):
        tensors = stage()
        forward = runner.forward.logits if forward is None else forward

        class Replay:
            def replay(self):
                out = forward(tensors)
                return tuple(map(share, out)) if isinstance(out, tuple) else share(out)  # (carry: logits, hidden)

        def share(out):
            key = (out.dtype, out.shape[1:])
            shared = pool.get(key)
            if shared is None or shared.shape[0] < out.shape[0]:
                shared = pool[key] = torch.empty((64, *out.shape[1:]), dtype=out.dtype)
            shared[:out.shape[0]].copy_(out)
            return shared[:out.shape[0]]

        return Replay()

    monkeypatch.setattr(cuda_graphs, "_capture", stand_in)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)


def run(reqs, graphs, depth=2, prepare=None, **kw):
    cfg = EngineConfig(**{**CFG, **kw}, pipeline_depth=depth)
    launches = []

    async def go():
        async with Engine(cfg) as engine:
            runner = engine._parts.runner
            runner.model.set_kernel_backend("triton")  # what a graph holds: the device attention (interpreted here)
            if graphs:
                cuda_graphs.install_graphs(runner, engine._parts.device, cfg)
            record_launches(runner, launches)
            if prepare is not None:
                prepare(runner)
            outs = await asyncio.gather(*(engine.complete(p, sp) for p, sp in reqs))
            return outs, runner, launches

    return asyncio.run(go())


@needs_triton
def test_logits_sampled_after_replays_in_both_slots_equal_eager(shared_pool_graphs):
    """Rows with logprobs or seeded random sampling replay decode graphs (never greedy ones) and
    sample eagerly. (Mutant: a greedy graph for any row set, ignoring the rows'
    flags, loses the logprobs and the random draws.)"""
    reqs = [(p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True)) for p in SHORT[:2]]
    reqs += [(p, SamplingParams(max_tokens=5, temperature=0.9, top_k=30, seed=i, ignore_eos=True))
             for i, p in enumerate(SHORT[2:4])]
    eager, _, _ = run(reqs, graphs=False)
    graphed, runner, _ = run(reqs, graphs=True)
    assert tokens(graphed) == tokens(eager)
    for g, w in zip(graphed[:2], eager[:2]):
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
    assert {slot for slot, _ in runner.graphs.replays} == {0, 1} and not runner.greedy_graphs.replays


def host_bound(runner) -> list:
    """The host waits for each step's copy before its tick ends (a host slower than the device,
    like the tiny model on an H100): the next tick finds the step done and commits it first.
    Returns the (slot, other slot in flight) of each launch."""
    sample, launch, seen = runner.launch_sampling, runner.launch_forward, []

    def waiting(step, rows=None, bitmask=None, final=True):
        sample(step, rows, bitmask, final)
        if final:
            step.copy_done.synchronize()

    def watched(step_id, packed, unmasked=False):
        busy = any(s.owner is not None for s in runner.slots)
        step = launch(step_id, packed, unmasked)
        seen.append((step.slot.index, busy))
        if step.sampled:  # (an unmasked step is sampled and copied inside its launch)
            step.copy_done.synchronize()
        return step

    runner.launch_sampling, runner.launch_forward = waiting, watched
    return seen


@needs_triton
def test_a_host_bound_loop_launches_each_step_after_committing_the_last(shared_pool_graphs):
    """Depth 2, host-bound: each step is launched only after the step before it was committed (never
    two steps in flight), in the slots in turn (ping-pong, as the runner hands them out since issue
    36; on 2026-11-27 the H100 saw slot 0 alone, {0} replays, which the same host-bound loop gave
    before). Every graph writes one shared buffer, so a step reading a later step's logits would
    change tokens or logprobs."""
    reqs = [(p, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=True)) for p in SHORT[:3]]
    eager, _, _ = run(reqs, graphs=False)
    watch = []
    graphed, runner, _ = run(reqs, graphs=True, prepare=lambda r: watch.append(host_bound(r)))
    seen = watch[0]
    assert tokens(graphed) == tokens(eager)
    for g, w in zip(graphed, eager):
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
    assert seen and not any(overlapped for _, overlapped in seen)
    assert [slot for slot, _ in seen] == [i % 2 for i in range(len(seen))]
    assert {slot for slot, _ in runner.graphs.replays} == {0, 1}


@needs_triton
def test_grammar_rows_switch_greedy_graphs_off(shared_pool_graphs):
    """(Mutant: replaying greedy graphs while a grammar is live samples the grammar rows without
    their masks.)"""
    register_grammar("alternating", _Alternating)
    try:
        spec = GrammarSpec("alternating", "x")
        reqs = [(p, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, grammar=spec)) if i % 3 == 0
                else (p, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)) for i, p in enumerate(SHORT[:4])]
        eager, _, _ = run(reqs, graphs=False, depth=1)
        graphed, runner, launches = run(reqs, graphs=True)
    finally:
        unregister_grammar("alternating")
    assert tokens(graphed) == tokens(eager)
    for i, out in enumerate(graphed):
        if i % 3 == 0:
            assert [t % 2 for t in out.token_ids] == [1, 0] * 3
    masked = [s for u, s, dec in launches if dec and not u]
    assert masked and not any(masked)
    assert any(s for u, s, dec in launches if u) and sum(runner.graphs.replays.values()) > 0


@needs_triton
def test_decode_steps_above_the_largest_bucket_mix_with_replays(shared_pool_graphs):
    """6 rows with buckets up to 2: eager steps, then replays as requests finish. (Mutant: a step
    above the largest bucket replays the largest graph.)"""
    reqs = [(p, SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True, logprobs=i % 2 == 0))
            for i, p in enumerate(SHORT)]
    eager, _, _ = run(reqs, graphs=False)
    graphed, runner, _ = run(reqs, graphs=True, graph_batch_sizes=(1, 2, 2))
    assert tokens(graphed) == tokens(eager)
    assert runner.graphs.eager_steps > 0
    assert sum(runner.graphs.replays.values()) + sum(runner.greedy_graphs.replays.values()) > 0


@needs_triton
def test_a_replay_while_the_other_slots_sampling_is_not_launched_is_refused(shared_pool_graphs):
    """The guard behind the shared pool: a replay could overwrite the logits of a step whose
    sampling is not enqueued yet, so the runner refuses to launch it."""
    from slipstream.errors import PipelineInvariantError
    from slipstream.runtime.batch import pack_step
    from slipstream.runtime.devices.cpu_device import CPUDevice
    from test_mixed_graphs import _runner

    device = CPUDevice()
    try:
        runner = _runner(device)
        cuda_graphs.install_graphs(runner, device, EngineConfig(**CFG))
        packed = pack_step(np.array([1, 2], np.int64), [])
        first = runner.launch_forward(0, packed)  # (masked: its sampling is launched apart)
        with pytest.raises(PipelineInvariantError, match="could overwrite"):
            runner.launch_forward(1, packed)
        runner.launch_sampling(first)  # now it may: stream order reads slot 0's logits first
        runner.slots[1].release()
        second = runner.launch_forward(1, packed)
        runner.launch_sampling(second)
        second.copy_done.synchronize()
        assert runner.graphs.replays == {(0, 2): 1, (1, 2): 1}
    finally:
        device.close()

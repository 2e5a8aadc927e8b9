"""Decode-only carry steps replay a carry decode graph (StepForward.carry: the kinds and values
read from the row tables on the device, the head encodings swapped in with torch.where, the hidden
states returned for the sampling groups); carry steps with chunks run eagerly; steps without carry
rows keep the plain decode graphs. The CPU tests install the graphs through the real install_graphs
with a stand-in capture (tests/test_graph_paths.py); the `cuda` test runs the real graphs. Both
compare with the engine without graphs at depth 1 and 2. (Mutants: the carry graph captured without
the swap — the values are not fed and the outputs differ; carry steps always eager — no carry replay.)"""
import asyncio

import pytest

from carry_util import install_heads, registered
from slipstream import Engine, SamplingParams
from slipstream.grammar import GrammarSpec
from slipstream.runtime.graphs import cuda_graphs
from test_cuda_paths import gpu
from test_graph_paths import CFG, shared_pool_graphs  # noqa: F401 - a fixture
from test_mixed_graphs import needs_triton

CARRY = [([1, 5 + i, 9, 40 + i, 7], SamplingParams(max_tokens=9, temperature=0.0,
                                                     grammar=GrammarSpec("carry_demo", str(4 + i))))
         for i in range(3)]
PLAIN = [([1, 8, 20 + i, 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)) for i in range(2)]


def run(cfg, reqs, graphs: bool, cpu_graphs: bool = False):
    """(outputs, stats): stats counts replays of the plain (decode + greedy) and carry graphs, and
    decode-only carry steps that ran eagerly."""
    stats = dict(plain=0, carry=0, eager_carry_decode=0)

    async def go():
        async with Engine(cfg) as engine:
            runner = engine._parts.runner
            install_heads(runner)
            if cpu_graphs:
                runner.model.set_kernel_backend("triton")  # what a graph holds (interpreted here)
                if graphs:
                    cuda_graphs.install_graphs(runner, engine._parts.device, cfg)
            elif not graphs:
                runner.graphs = runner.greedy_graphs = runner.carry_graphs = runner.mixed_graphs = None
            launch_eager = runner._launch_eager

            def counting(step):
                stats["eager_carry_decode"] += step.staged.carry and step.staged.packed.decode_only
                launch_eager(step)

            runner._launch_eager = counting
            outs = await asyncio.gather(*(engine.complete(p, sp) for p, sp in reqs))
            plain = (runner.graphs, runner.greedy_graphs)
            stats["plain"] = sum(sum(g.replays.values()) for g in plain if g is not None)
            if runner.carry_graphs is not None:
                stats["carry"] = sum(runner.carry_graphs.replays.values())
            return outs, stats

    with registered():
        return asyncio.run(go())


def check(graphed, eager):
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for g, e in zip(graphed, eager):
        if e.carried is None:
            assert g.carried is None
        else:
            assert g.carried.keys() == e.carried.keys()
            for k in e.carried:
                assert g.carried[k] == pytest.approx(e.carried[k], abs=1 / 32 + 1e-6)


@needs_triton
@pytest.mark.parametrize("depth", [1, 2])
def test_decode_carry_steps_replay_carry_graphs_and_equal_eager(shared_pool_graphs, depth):  # noqa: F811
    from slipstream import EngineConfig

    cfg = EngineConfig(**CFG, pipeline_depth=depth)
    eager, _ = run(cfg, CARRY + PLAIN, graphs=False, cpu_graphs=True)
    graphed, stats = run(cfg, CARRY + PLAIN, graphs=True, cpu_graphs=True)
    check(graphed, eager)
    assert all(e.carried for e in eager[:len(CARRY)])  # (the values were fed and reported)
    assert stats["carry"] > 0 and stats["eager_carry_decode"] == 0
    _, stats = run(cfg, PLAIN, graphs=True, cpu_graphs=True)
    assert stats["plain"] > 0 and stats["carry"] == 0  # steps without carry rows: the plain graphs


@pytest.mark.cuda
@pytest.mark.parametrize("depth", [1, 2])
def test_cuda_decode_carry_steps_replay_carry_graphs_and_equal_the_engine_without_graphs(depth):
    reqs = CARRY + PLAIN
    eager, _ = run(gpu(pipeline_depth=depth), reqs, graphs=False)
    graphed, stats = run(gpu(pipeline_depth=depth), reqs, graphs=True)
    check(graphed, eager)
    assert stats["carry"] > 0 and stats["eager_carry_decode"] == 0
    _, plain = run(gpu(pipeline_depth=depth), PLAIN, graphs=True)
    assert plain["plain"] > 0 and plain["carry"] == 0

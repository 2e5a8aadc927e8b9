"""Carry steps never replay a CUDA graph: a graph holds the decode step without the carry (no typed
input, no hidden states), so a step with a carry row runs eagerly (ModelRunner.launch_forward,
runtime/carry.py). The CPU test installs decode graphs through the real install_graphs with a
stand-in capture (tests/test_graph_paths.py); the `cuda` test runs the real graphs. Both compare with
the engine without graphs. (Mutant: _choose_graph for carry steps too — replays happen, the
values are not fed and the outputs differ.)"""
import asyncio

import pytest

from carry_util import install_heads, registered
from slipstream import Engine, SamplingParams
from slipstream.grammar import GrammarSpec
from slipstream.runtime import cuda_graphs
from test_cuda_paths import gpu
from test_graph_paths import CFG, shared_pool_graphs  # noqa: F401 - a fixture
from test_mixed_graphs import needs_triton

CARRY = [([1, 5 + i, 9, 40 + i, 7], SamplingParams(max_tokens=9, temperature=0.0,
                                                     grammar=GrammarSpec("carry_demo", str(4 + i))))
         for i in range(3)]
PLAIN = [([1, 8, 20 + i, 3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)) for i in range(2)]


def run(cfg, reqs, graphs: bool, cpu_graphs: bool = False):
    async def go():
        async with Engine(cfg) as engine:
            runner = engine._parts.runner
            install_heads(runner)
            if cpu_graphs:
                runner.model.set_kernel_backend("triton")  # what a graph holds (interpreted here)
                if graphs:
                    cuda_graphs.install_graphs(runner, engine._parts.device, cfg)
            elif not graphs:
                runner.graphs = runner.greedy_graphs = runner.mixed_graphs = None
            outs = await asyncio.gather(*(engine.complete(p, sp) for p, sp in reqs))
            replays = sum(sum(g.replays.values()) for g in (runner.graphs, runner.greedy_graphs) if g is not None)
            return outs, replays

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
def test_carry_steps_run_eagerly_beside_graphed_decode_steps(shared_pool_graphs):  # noqa: F811
    from slipstream import EngineConfig

    cfg = EngineConfig(**CFG, pipeline_depth=2)
    eager, _ = run(cfg, CARRY, graphs=False, cpu_graphs=True)
    graphed, replays = run(cfg, CARRY, graphs=True, cpu_graphs=True)
    assert replays == 0  # every decode step had a carry row
    check(graphed, eager)
    _, replays = run(cfg, PLAIN, graphs=True, cpu_graphs=True)
    assert replays > 0  # (the graphs are installed and used for steps without carry rows)


@pytest.mark.cuda
def test_cuda_carry_steps_run_eagerly_and_equal_the_engine_without_graphs():
    reqs = CARRY + PLAIN
    eager, _ = run(gpu(pipeline_depth=2), reqs, graphs=False)
    graphed, replays = run(gpu(pipeline_depth=2), reqs, graphs=True)
    check(graphed, eager)
    _, only_carry = run(gpu(pipeline_depth=2), CARRY, graphs=True)
    assert only_carry == 0 and replays > 0  # the plain rows' last steps (carry rows done) replayed

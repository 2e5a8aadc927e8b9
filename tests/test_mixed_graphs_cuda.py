"""Graphs of mixed and prefill steps on a GPU: real captures against the eager forward, the same
steps as tests/test_mixed_graphs.py (which checks the layout and the routing without a GPU); and the
profiling tool's exit without one."""
import asyncio

import numpy as np
import pytest
import torch

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.runtime.graphs.buckets import pick_bucket, token_buckets
from test_engine_tiny import mixed_requests
from test_mixed_graphs import PAGE, PAGES_PER_ROW, STEPS, _run, _tables


def _cuda_cfg(**kw):
    base = dict(model="tiny-random", device="cuda", max_batch_size=7, max_num_batched_tokens=64,
                kv_cache_tokens=8192, page_size=PAGE, graph_batch_sizes=(1, 4, 7))
    base.update(kw)
    return EngineConfig(**base)


async def _cuda_steps(**kw):
    async with Engine(_cuda_cfg(**kw)) as engine:
        runner = engine._parts.runner
        runner.kv.k.zero_()  # (the pool is uninitialised: pages no step fills must compare equal)
        runner.kv.v.zero_()
        logits = _run(runner, STEPS, hidden_states=False)
        tables = {k: v.cpu() for k, v in _tables(runner).items()}
        used = slice(PAGE, PAGE * (1 + PAGES_PER_ROW * 6))  # every row's pages, not the scratch page
        kv = runner.kv.k[:, used].float().cpu(), runner.kv.v[:, used].float().cpu()
        cache = runner.mixed_graphs  # None without mixed graphs; its graphs read before close releases them
        return [w for w, _ in logits], tables, kv, cache and sorted(cache.graphs)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_cuda_mixed_graph_replay_equals_eager(dtype, tol):
    """Real graphs of buckets 16, 32 and 64 (chunks only; decode rows + final and non-final chunks;
    one capture replayed for two different steps) against the eager forward of the same steps."""
    want, t_want, kv_want, _ = asyncio.run(_cuda_steps(dtype=dtype, mixed_graphs=False))
    got, t_got, kv_got, captured = asyncio.run(_cuda_steps(dtype=dtype, warmup=False))
    assert captured == [(0, 32), (0, 64), (1, 16), (1, 32)]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)  # other matmul row counts may round differently
    for name in t_want:
        if name in ("pos", "pages", "top_k", "seed", "output_index", "temperature"):
            assert torch.equal(t_got[name], t_want[name]), name
    torch.testing.assert_close(kv_got, kv_want, rtol=tol, atol=tol)


@pytest.mark.cuda
def test_cuda_engine_with_mixed_graphs_gives_the_eager_tokens_and_replays_them():
    reqs = [(p, SamplingParams(max_tokens=sp.max_tokens, temperature=0.0), d) for p, sp, d in mixed_requests(24, 5)]

    async def run(**kw):
        async with Engine(_cuda_cfg(max_batch_size=16, graph_batch_sizes=(1, 4, 16), **kw)) as engine:
            outs = await asyncio.gather(*(engine.complete(p, sp) for p, sp, _ in reqs))
            cache = engine._parts.runner.mixed_graphs  # (read before close, which releases the graphs)
            return [o.token_ids for o in outs], cache and (sorted(cache.graphs), sum(cache.replays.values()))

    eager, _ = asyncio.run(run(mixed_graphs=False))
    graphed, (captured, replays) = asyncio.run(run(warmup=False))
    assert graphed == eager
    assert captured and {t for _, t in captured} <= {16, 32, 64} and replays > 0


@pytest.mark.cuda
def test_cuda_mixed_graph_buckets_pick_the_smallest_holding_the_step():
    buckets = token_buckets(*_cuda_cfg().token_bucket_range())
    assert buckets == [16, 32, 64]
    assert [pick_bucket(buckets, n) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, None]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_profile_tool_parses_its_arguments_and_exits_2_without_a_gpu(capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "gpu" / "profile_mixed_cuda.py"
    spec = importlib.util.spec_from_file_location("profile_mixed_cuda", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--tokens", "128", "512", "2048", "--repeats", "3"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        tool.main(["--tokens", "8", "--decode", "16"])
    assert bad.value.code == 2
    packed, last_row = tool.mixed_step(512, 16, 256, np.random.default_rng(0))
    assert packed.num_tokens == 512 and packed.num_decode == 16 and last_row == 16 + 2

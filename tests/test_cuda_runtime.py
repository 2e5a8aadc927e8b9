"""The CUDA runtime. CPU tests: the import path without cupy or a GPU. `cuda` tests (skipped
without a GPU): depth 2 == depth 1, GPU == transformers, graph replay == eager, no hidden sync or
allocation in the steady-state tick, bucket choice, warmup logs, every event-wait strategy."""
import asyncio
import subprocess
import sys

import numpy as np
import pytest
import structlog
import torch

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.runtime.batch import pack_step
from slipstream.runtime.graphs.buckets import make_buckets, pick_bucket
from idefics3_fixture import idefics3_folder  # noqa: F401 (a pytest fixture)
from moondream_fixture import moondream_folder  # noqa: F401 (a pytest fixture)
from test_engine_tiny import mixed_requests


def test_cuda_modules_import_without_cupy_or_gpu():
    code = ("import sys; sys.modules['cupy'] = None\n"  # importing cupy now raises ImportError
            "import slipstream.runtime.devices.cuda_device as cd, slipstream.runtime.graphs.cuda_graphs, slipstream.api.engine\n"
            "assert cd.load_cupy() is None\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")
    out = subprocess.run([sys.executable, "-c", "import slipstream.api.engine, slipstream.runtime.devices.cuda_device, sys; "
                          "print('cupy' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False"  # cupy is imported lazily, only by a CUDA device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_device_without_gpu_is_a_clear_error():
    from slipstream.runtime.devices.make import make_device

    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        make_device("cuda")


# --- on a GPU -------------------------------------------------------------------------------

def cuda_cfg(depth=2, **kw):
    base = dict(model="tiny-random", device="cuda", pipeline_depth=depth, max_batch_size=16,
                max_num_batched_tokens=64, kv_cache_tokens=8192, page_size=8, graph_batch_sizes=(1, 4, 16))
    base.update(kw)
    return EngineConfig(**base)


async def _complete_all(cfg, reqs, inspect=lambda engine: engine):
    """(token ids, inspect(engine)): inspect runs before close, which releases the graphs."""
    async with Engine(cfg) as engine:
        outs = await asyncio.gather(*(engine.complete(p, sp) for p, sp, _ in reqs))
        return [o.token_ids for o in outs], inspect(engine)


def _replays(engine):
    """(decode and greedy replays by (slot, bucket), mixed replays): counted while the engine is open."""
    runner = engine._parts.runner
    return runner.graphs.replays + runner.greedy_graphs.replays, sum(runner.mixed_graphs.replays.values())


@pytest.mark.cuda
def test_depth2_equals_depth1_on_gpu_64_mixed_requests(monkeypatch):
    """Host-bound (the tiny model: slot 0 relaunched after each commit) and device-bound (replays
    slowed: both slots in flight, test_cuda_paths.device_bound), depth 2 gives depth 1's tokens."""
    from test_cuda_paths import device_bound

    reqs = [(p, SamplingParams(max_tokens=sp.max_tokens, temperature=0.0, stop=sp.stop,
                               stop_token_ids=sp.stop_token_ids), d) for p, sp, d in mixed_requests(64)]
    d1, _ = asyncio.run(_complete_all(cuda_cfg(1), reqs))
    d2, (decode_steps, mixed_steps) = asyncio.run(_complete_all(cuda_cfg(2), reqs, _replays))
    assert d2 == d1
    assert sum(decode_steps.values()) >= 20 and mixed_steps > 0  # (warmup captured every bucket: count replays)
    device_bound(monkeypatch)
    slowed, (decode_steps, _) = asyncio.run(_complete_all(cuda_cfg(2), reqs, _replays))
    assert slowed == d1
    assert {slot for slot, _ in decode_steps} == {0, 1}


def _hf_twin(dtype):
    """transformers' Llama with exactly the weights of slipstream's tiny-random model, on the GPU."""
    from slipstream.models.llama.build import random_weights
    from slipstream.models.config import tiny_config
    from hf_oracle import hf_llama_from_weights

    return hf_llama_from_weights(tiny_config(), random_weights(tiny_config(), seed=0)).to(device="cuda", dtype=dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, min_agree", [("float32", 1.0), ("bfloat16", 0.75)])
def test_gpu_greedy_matches_transformers_on_the_gpu(dtype, min_agree):
    """float32: identical tokens. bfloat16: both round differently (kernels, fused ops), so a late
    near-tie may flip; we require the first tokens to agree on most prompts."""
    torch_dtype = getattr(torch, dtype)
    hf = _hf_twin(torch_dtype)
    prompts = [[5 + i, 40 + 3 * i, 7, 99 - i, 12 + i] * (1 + i % 3) for i in range(8)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours, _ = asyncio.run(_complete_all(cuda_cfg(dtype=dtype), [(p, params, 0) for p in prompts]))
    agree = 0
    for p, got in zip(prompts, ours):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert ref  # transformers may stop at EOS (2): compare what it produced
        agree += got[:8] == ref[:8]
        if dtype == "float32":
            assert got[: len(ref)] == ref
    assert agree / len(prompts) >= min_agree


@pytest.mark.cuda
def test_graph_replay_equals_eager_forward():
    async def run():
        async with Engine(cuda_cfg()) as engine:
            runner = engine._parts.runner
            kv = runner.kv
            torch.manual_seed(0)
            kv.k.normal_()
            kv.v.normal_()
            runner.rows.last_token.random_(3, 500)
            for n in (1, 3, 4, 9, 16):
                rows = list(range(1, n + 1))
                for i, r in enumerate(rows):  # row r: position 5 + 7i, pages 1 + 16i ...
                    runner.rows.pages[r, :16] = torch.arange(1 + 16 * i, 17 + 16 * i)
                positions = torch.tensor([5 + 7 * i for i in range(n)], device=kv.k.device)

                def hold() -> None:  # every forward advances the rows' positions: reset them
                    runner.rows.pos[1:n + 1] = positions

                packed = pack_step(np.array(rows), [])
                arena, compute = runner.slots[0].arena, runner.device.compute.stream
                layout = arena.fill(packed)
                arena.upload()
                with torch.cuda.stream(compute):
                    hold()
                    eager = runner.forward.logits(arena.tensors(layout))[:n].clone()
                torch.cuda.synchronize()
                bucket, graph = runner.graphs.lookup(0, n)
                assert bucket == pick_bucket(make_buckets(1, 4, 16), n)
                arena.fill(packed, pad_decode=bucket)
                arena.upload()
                with torch.cuda.stream(compute):
                    hold()
                    replayed = graph.replay()[:n].clone()
                torch.cuda.synchronize()
                if bucket == n:
                    assert torch.equal(replayed, eager)
                else:  # other matmul shapes: rounding may differ in the last bits
                    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)

    asyncio.run(run())


def _no_sync_workload():
    """Greedy rows, and one row of each path that moves data between host and device differently:
    seeded random sampling with top-k/top-p/min_p, penalties and min_tokens (history admission),
    logprobs and top_logprobs < 20 on several rows (the copy-back), a grammar row (mask upload,
    late sampling)."""
    from test_cuda_paths import _Alternating

    from slipstream.grammar import GrammarSpec, register_grammar, unregister_grammar

    try:
        register_grammar("alternating", _Alternating)
    except ValueError:  # registered by an earlier test of this process
        pass
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    special = [SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7, ignore_eos=True),
               SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=1.0, repetition_penalty=1.2,
                              ignore_eos=True),
               SamplingParams(max_tokens=24, temperature=0.0, min_tokens=4, stop_token_ids=[5]),
               SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=3, ignore_eos=True),
               SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=5, ignore_eos=True),
               SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                              grammar=GrammarSpec("alternating", "x"))]
    return [greedy] * 2 + special, lambda: unregister_grammar("alternating")


@pytest.mark.cuda
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "every-sampling-path"])
def test_steady_state_tick_has_no_hidden_sync_and_no_device_allocation(sampled):
    prompts = [[3 + i] * 6 for i in range(8)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 8
    done = lambda: None  # noqa: E731
    if sampled:
        params, done = _no_sync_workload()

    async def run():
        async with Engine(cuda_cfg()) as engine:
            await asyncio.gather(*(engine.complete(p, sp) for p, sp in zip(prompts, params)))  # warm every shape once
            allocs = torch.cuda.memory_stats().get("num_device_alloc")
            torch.cuda.set_sync_debug_mode("error")  # any synchronising call in the loop now raises
            try:
                outs = await asyncio.gather(*(engine.complete(p, sp) for p, sp in zip(prompts, params)))
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert all(len(o.token_ids) >= 4 for o in outs) and len(outs[0].token_ids) == 24
            if sampled:
                assert [len(a) for a in outs[5].top_logprobs] == [3] * 24
            if allocs is not None:
                assert torch.cuda.memory_stats()["num_device_alloc"] == allocs

    try:
        asyncio.run(run())
    finally:
        done()


@pytest.mark.cuda
def test_warmup_logs_every_bucket_and_skipping_it_captures_on_first_use():
    """(2026-11-27 on an H100: KeyError 'batch_size' — the test read a decode field off the mixed
    kind's first-use line, which has `tokens`; the CPU twin is in tests/test_graph_record.py.)"""
    from test_graph_record import check_graph_log_fields

    one = [([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), 0)]
    with structlog.testing.capture_logs() as warm:
        asyncio.run(_complete_all(cuda_cfg(), one))
    with structlog.testing.capture_logs() as lazy:
        asyncio.run(_complete_all(cuda_cfg(warmup=False), one))
    check_graph_log_fields(warm, lazy, make_buckets(1, 4, 16), [16, 32, 64], slots=2)


async def _measured_without_sync(cfg, warm, measured):
    """warm(engine) once (kernels compiled, graphs captured, shapes seen), then measured(engine)
    with torch's sync debug mode on (CUDA): any synchronising call anywhere in the process raises,
    which fails the step (or the preprocessing) and so the request. On the CPU the same workload
    runs without the mode (the test's own logic, checked without a GPU). Returns (engine, what
    measured() returned)."""
    on_gpu = cfg.device == "cuda"
    async with Engine(cfg) as engine:
        await warm(engine)
        if on_gpu:
            torch.cuda.set_sync_debug_mode("error")
        try:
            return engine, await measured(engine)
        finally:
            if on_gpu:
                torch.cuda.set_sync_debug_mode(0)


GREEDY8 = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ON = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


def on(device, **kw):
    """cuda_cfg on `device` (the CPU ignores its graph settings)."""
    return cuda_cfg(device=device, **kw)


@pytest.mark.cuda
def test_pinned_pixels_are_one_contiguous_pinned_range():
    """Tensor.pin_memory() keeps a strided layout; the encoder launch copies only a contiguous one."""
    from slipstream.models.idefics3.processor import ProcessedImage
    from slipstream.runtime.devices.host_copy import pin_pixels, stage_pixels

    strided = torch.arange(2 * 8 * 8 * 3, dtype=torch.float32).reshape(2, 8, 8, 3).permute(0, 3, 1, 2)
    image = ProcessedImage(strided, torch.ones(2, 8, 8, dtype=torch.bool), rows=0, cols=0, num_image_tokens=8)
    pinned = pin_pixels(image).pixel_values
    assert pinned.is_pinned() and pinned.is_contiguous() and torch.equal(pinned, strided)
    assert torch.equal(stage_pixels(pinned, torch.device("cuda")).cpu(), strided)


@ON
def test_an_idefics3_image_step_has_no_hidden_sync(idefics3_folder, device):
    """The encoder launch (pixels pinned off the loop, copied asynchronously: host_copy.stage_pixels)
    and the step that gathers its features, beside decode rows; a new picture each round, so the
    measured round encodes (no encoder-cache hit)."""
    from image_util import picture

    prompt = "<|im_start|>User:<image>What is this?<end_of_utterance>\nAssistant:"
    cfg = on(device, model=str(idefics3_folder), max_num_batched_tokens=256)

    def both(seed):
        async def go(engine):
            return await asyncio.gather(engine.complete(prompt, GREEDY8, images=[picture(100, 150, seed)]),
                                        engine.complete("Hello there", GREEDY8))
        return go

    engine, outs = asyncio.run(_measured_without_sync(cfg, both(1), both(2)))
    assert [len(o.token_ids) for o in outs] == [8, 8]


@ON
def test_a_moondream_point_and_detect_step_has_no_hidden_sync(moondream_folder, device):
    """Moondream's own encode (pixels on the device before encode_image) and its carry steps (region
    values fed back on the device), point and detect at once, a new picture per round."""
    from image_util import picture

    cfg = on(device, model=str(moondream_folder))

    def both(seed):
        async def go(engine):
            return await asyncio.gather(engine.point("", "cat", 3, images=[picture(60, 40, seed)]),
                                        engine.detect("", "tree", 3, images=[picture(44, 52, seed + 10)]))
        return go

    engine, (point, detect) = asyncio.run(_measured_without_sync(cfg, both(1), both(2)))
    assert list(point) == ["points"] and list(detect) == ["objects"]


@ON
def test_a_prefix_cache_hit_step_has_no_hidden_sync(device):
    """Requests whose first pages are cached by the warm round: their pages are mapped at admission
    and their first chunk starts past the hit."""
    shared = [11 + i % 50 for i in range(40)]  # 5 full pages of 8 tokens

    def round_(first):
        async def go(engine):
            cache = engine._parts.loop.planner.prefix_cache
            before = cache.stats().hits
            outs = await asyncio.gather(*(engine.complete(shared + [first + i, 3], GREEDY8) for i in range(4)))
            return outs, cache.stats().hits - before
        return go

    _, (outs, hits) = asyncio.run(_measured_without_sync(on(device, max_num_batched_tokens=128), round_(100), round_(200)))
    assert all(len(o.token_ids) == 8 for o in outs)
    assert hits >= 4 * len(shared)  # every request of the measured round took the 5 pages from the cache


@pytest.mark.cuda
@pytest.mark.parametrize("event_wait", ["thread", "poll", "host_func"])
def test_every_event_wait_strategy_gives_the_same_tokens(event_wait):
    if event_wait == "host_func":
        pytest.importorskip("cupy")
    reqs = [([7 + i, 8, 9], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), 0) for i in range(4)]
    base, _ = asyncio.run(_complete_all(cuda_cfg(cuda_graphs=False), reqs))
    got, _ = asyncio.run(_complete_all(cuda_cfg(event_wait=event_wait), reqs))
    assert got == base


@pytest.mark.cuda
def test_closed_engine_releases_its_device_memory():
    """Weights, KV pool, graphs and their pool, arenas: nothing outlives the engine. torch keeps a
    cuBLAS workspace per stream a matmul ran on (the engine's streams are new), so those are
    cleared before comparing."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    reqs = [([7 + i, 8, 9], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), 0) for i in range(3)]
    # the closed Engine stays referenced, as `async with ... as engine` leaves it (tests/test_engine_close.py)
    _, (engine, held) = asyncio.run(_complete_all(cuda_cfg(kv_cache_tokens=65536), reqs,
                                                  lambda e: (e, e._parts.runner.kv.bytes())))
    assert held > 4 * 2**20  # a leaked pool would show
    gc.collect()
    torch.cuda.synchronize()
    getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
    leaked = torch.cuda.memory_allocated() - before
    assert leaked < 2**20, f"{leaked / 2**20:.1f} MiB still allocated after close (KV pool was {held / 2**20:.0f} MiB)"

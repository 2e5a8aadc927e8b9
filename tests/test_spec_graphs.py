"""Speculation at graph speed (issue 49), checked on the CPU with fakes at least as asynchronous as a
GPU (tests/sync_device.py: host and device memory apart, uploads and copies on streams of their own,
the launch code and launched work under a sync detector):
  * a speculating step launches with no host sync and no blocking copy (its layout staged through
    the slot's host buffer: `SpecStaging`), and greedy output equals the output without speculation;
  * plain steps with speculation on write the token history inside their forward (inside their
    graph), with no launch of their own;
  * speculating steps replay a graph per (slot, bucket of rows) after warm-up (a stand-in capture
    that runs the captured function again on the views it staged), give the eager step's tokens,
    and the eager-step count stays 0 in steady state.
The `cuda` test runs the same with torch's sync debug mode and real graphs."""
import asyncio

import pytest
import torch

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.api import assemble
from slipstream.params import SpeculativeConfig
from sync_device import SeparateMemoryDevice, check_runner, use_torch_paths

SPEC = SpeculativeConfig(num_drafts=3, adaptive=False)
BASE = dict(model="tiny-random", max_batch_size=4, max_num_batched_tokens=64, kv_cache_tokens=1024, page_size=8)
PROMPTS = [[5 + i, 9, 11, 40] * 6 for i in range(3)]  # repetitive: the n-gram drafter finds matches
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


def run_separate(monkeypatch, spec, depth=2, upload_delay_s=0.0, prompts=PROMPTS, params=GREEDY, prepare=None, **kw):
    """(token ids, stats, syncs, device) of `prompts` completed twice on a SeparateMemoryDevice, the
    second time (warm) under the sync detector; `prepare(engine)` first; `params`: one for all, or a
    list (one per prompt)."""
    devices = []
    monkeypatch.setattr(assemble, "make_device",
                        lambda *a, **k: devices.append(SeparateMemoryDevice(upload_delay_s=upload_delay_s))
                        or devices[-1])
    cfg = EngineConfig(**{**BASE, **kw}, speculative=spec, pipeline_depth=depth)

    async def go():
        async with Engine(cfg) as engine:
            device = devices[-1]
            if prepare is not None:
                prepare(engine)
            check_runner(device, engine._parts.runner)
            jobs = list(zip(prompts, params if isinstance(params, list) else [params] * len(prompts)))
            await asyncio.gather(*(engine.complete(p, q) for p, q in jobs))  # warm: first-use allocations
            device.checking = True
            try:
                outs = await asyncio.gather(*(engine.complete(p, q) for p, q in jobs))
            finally:
                device.checking = False
            return [o.token_ids for o in outs], await engine.stats(), device

    tokens, stats, device = asyncio.run(go())
    return tokens, stats, device.syncs, device


@pytest.mark.parametrize("depth", [1, 2])
def test_a_speculating_step_launches_without_a_host_sync(monkeypatch, depth):
    """(Before: spec_layout's four `torch.from_numpy(a).to(device)` per step, blocking copies that on
    CUDA make the host wait for the step in flight.) Uploads run late here, so a layout buffer
    rewritten while its copy is pending would change the tokens."""
    use_torch_paths(monkeypatch)
    want, _, plain_syncs, _ = run_separate(monkeypatch, None, depth)
    got, stats, syncs, _ = run_separate(monkeypatch, SPEC, depth, upload_delay_s=0.002)
    assert stats["speculative"]["drafted"] > 0 and stats["speculative"]["accepted"] > 0
    assert syncs == [] and plain_syncs == [], (syncs or plain_syncs)[0]
    assert got == want


class _ReplayAgain:
    """A stand-in graph: the function captured, run again on the views staged at capture."""

    def __init__(self, forward, tensors):
        self.forward, self.tensors, self.replays = forward, tensors, 0

    def replay(self):
        self.replays += 1
        return self.forward(self.tensors)


@pytest.fixture
def stand_in_graphs(monkeypatch):
    from slipstream.runtime.graphs import cuda_graphs

    def capture(runner, device, pool, stage, forward=None):
        return _ReplayAgain(runner.forward.logits if forward is None else forward, stage())

    monkeypatch.setattr(cuda_graphs, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    return cuda_graphs


GRAPHS = dict(graph_batch_sizes=(1, 2, 4), mixed_graphs=False)


def test_plain_steps_with_speculation_on_write_the_history_inside_their_graphs(monkeypatch, stand_in_graphs):
    """Rows that opt out of speculation beside a runner with it on: each decode step replays its
    (greedy) graph, which writes the rows' inputs into the token history; nothing else runs beside
    it on the compute stream (before: an eager `spec_record` launch after every plain step), and the
    history holds each sequence through its last input."""
    use_torch_paths(monkeypatch)
    opt_out = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, speculative=False)
    seen = {}

    def install(engine):
        runner = engine._parts.runner
        stand_in_graphs.install_graphs(runner, engine._parts.device, EngineConfig(**BASE, **GRAPHS))
        seen["runner"] = runner

    want, _, _, _ = run_separate(monkeypatch, None, params=opt_out, **GRAPHS)
    got, stats, syncs, device = run_separate(monkeypatch, SPEC, params=opt_out, prepare=install, **GRAPHS)
    runner = seen["runner"]
    assert got == want and syncs == []
    replays = sum(runner.greedy_graphs.replays.values())
    assert replays > 0 and stats["speculative"]["drafted"] == 0
    compute = [label for stream, label in device.launches if stream == "compute"]
    assert set(compute) == {"forward", "sample"}  # (a replay, then the stamp)
    history = runner.spec.history
    held = {tuple(history.tokens[row, :int(history.length[row])].tolist()) for row in range(1, 4)}
    assert held == {tuple(p + out[:-1]) for p, out in zip(PROMPTS, got)}


def count_eager_decode(runner, counts, ks) -> None:
    """counts["plain"] / ["spec"] += each decode-only step launched without a graph; ks: each
    speculating step's draft counts."""
    launch = runner.launch_forward

    def counting(step_id, packed, unmasked=False):
        before = runner.eager_steps
        step = launch(step_id, packed, unmasked)
        if packed.decode_only and runner.eager_steps > before:
            counts["spec" if packed.num_drafts is not None else "plain"] += 1
        if packed.num_drafts is not None:
            ks.append(tuple(packed.num_drafts.tolist()))
        return step

    runner.launch_forward = counting


@pytest.mark.parametrize("depth", [1, 2])
def test_speculating_steps_replay_graphs_and_give_the_eager_steps_tokens(monkeypatch, stand_in_graphs, depth):
    """With graphs installed, every speculating step (plain greedy rows, up to the largest bucket)
    replays the speculating graph of its slot and bucket: the same tokens as without speculation and
    as speculating eagerly, no host sync, and no decode step counted eager (stats' eager_steps: only
    the prompts' steps, which have no graph with the CPU kernels). (Before: every speculating step
    ran eagerly.)"""
    use_torch_paths(monkeypatch)
    counts, ks, seen, caches = dict(plain=0, spec=0), [], {}, []

    def zero_kv(engine):
        kv = engine._parts.runner.kv
        kv.k.zero_(), kv.v.zero_()
        caches.append(kv)

    def install(engine):
        zero_kv(engine)
        runner = engine._parts.runner
        stand_in_graphs.install_graphs(runner, engine._parts.device, EngineConfig(**BASE, **GRAPHS))
        count_eager_decode(runner, counts, ks)
        seen["runner"] = runner

    want, _, _, _ = run_separate(monkeypatch, None, depth, **GRAPHS)
    got, stats, syncs, _ = run_separate(monkeypatch, SPEC, depth, prepare=install, **GRAPHS)
    assert got == want and syncs == []
    if depth == 1:  # speculating eagerly: (the same plans: the same pages) the same K/V at every fed position
        eager, _, _, _ = run_separate(monkeypatch, SPEC, depth, prepare=zero_kv, **GRAPHS)
        assert eager == got
        page = BASE["page_size"]
        for a, b in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
            torch.testing.assert_close(a[:, page:], b[:, page:], rtol=1e-5, atol=1e-5)  # (page 0: scratch)
    assert stats["speculative"]["accepted"] > 0
    replays = seen["runner"].spec_graphs.replays
    assert sum(replays.values()) > 0 and {b for _, b in replays} <= {1, 2, 4}
    assert counts == dict(plain=0, spec=0)
    # masked positions were fed: rows with fewer drafts than K (beside fuller ones), padding rows
    assert any(len(set(k)) > 1 for k in ks) and any(len(k) == 3 for k in ks)
    runner = seen["runner"]
    graphed = sum(sum(c.replays.values()) for c in (runner.spec_graphs, runner.graphs, runner.greedy_graphs))
    assert 0 < stats["eager_steps"] == stats["steps"] - graphed  # (the prompts' steps: no mixed graphs here)


@pytest.mark.parametrize("depth", [1, 2])
def test_sampled_rows_replay_the_forward_graph_and_verify_after_it(monkeypatch, stand_in_graphs, depth):
    """Seeded random rows (temperature 0.8) and a greedy one speculate from the sampled speculating
    graphs (proposal and forward; verification eager behind the replay, on the compute stream): the
    tokens equal those without speculation, no host sync, no decode step eager. (Before: every such
    step ran wholly eagerly.)"""
    use_torch_paths(monkeypatch)
    counts, ks, seen = dict(plain=0, spec=0), [], {}
    sampled = [SamplingParams(max_tokens=14, temperature=0.8, seed=40 + i, ignore_eos=True) for i in range(2)]

    def install(engine):
        runner = engine._parts.runner
        stand_in_graphs.install_graphs(runner, engine._parts.device, EngineConfig(**BASE, **GRAPHS))
        count_eager_decode(runner, counts, ks)
        seen["runner"] = runner

    params = [*sampled, GREEDY]
    want, _, _, _ = run_separate(monkeypatch, None, depth, params=params, **GRAPHS)
    got, stats, syncs, _ = run_separate(monkeypatch, SPEC, depth, params=params, prepare=install, **GRAPHS)
    assert got == want and syncs == []
    assert stats["speculative"]["accepted"] > 0
    runner = seen["runner"]
    assert sum(runner.spec_sampled_graphs.replays.values()) > 0
    assert counts == dict(plain=0, spec=0)


def test_speculating_graphs_carry_the_lora_bank(monkeypatch, stand_in_graphs):
    """With a device LoRA bank (CUDA: models/lora_bank.py), every captured forward holds the LoRA kernels,
    the speculating graphs' too, so drafts verify with each row's adapter whatever was loaded after the
    capture. (Before: the speculating forward carried no LoraInput.) A stand-in bank: with no adapter in
    it the reference backend adds nothing."""
    use_torch_paths(monkeypatch)
    bank, seen, calls = object(), {}, []

    def install(engine):
        runner = engine._parts.runner
        runner.forward.lora_bank = bank
        model = runner.model
        forward = model.forward

        def spy(batch, kv, *args, **kwargs):
            calls.append(batch.lora is not None and batch.lora.bank is bank)
            return forward(batch, kv, *args, **kwargs)

        monkeypatch.setattr(model, "forward", spy)
        stand_in_graphs.install_graphs(runner, engine._parts.device, EngineConfig(**BASE, **GRAPHS))
        seen["runner"] = runner

    want, _, _, _ = run_separate(monkeypatch, None, **GRAPHS)
    got, stats, _, _ = run_separate(monkeypatch, SPEC, prepare=install, **GRAPHS)
    assert got == want and sum(seen["runner"].spec_graphs.replays.values()) > 0
    assert calls and all(calls)


SEEDED = SamplingParams(max_tokens=14, temperature=0.8, seed=41, ignore_eos=True)


@pytest.mark.cuda
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_cuda_speculating_steps_replay_graphs_without_a_host_sync(params):
    """On a GPU: after a warm run, speculating steps replay their graphs (seeded rows: the sampled
    speculating graphs, verified eagerly behind them) under torch's sync debug mode (any
    synchronising call raises, failing the request), no decode step is eager, and float32 output
    equals the output without speculation."""
    cfg = dict(BASE, device="cuda", graph_batch_sizes=(1, 2, 4))
    counts, ks = dict(plain=0, spec=0), []

    async def run(spec):
        async with Engine(EngineConfig(**cfg, speculative=spec)) as engine:
            await asyncio.gather(*(engine.complete(p, params) for p in PROMPTS))  # warm: every shape once
            runner = engine._parts.runner
            count_eager_decode(runner, counts, ks)
            torch.cuda.set_sync_debug_mode("error")
            try:
                outs = await asyncio.gather(*(engine.complete(p, params) for p in PROMPTS))
            finally:
                torch.cuda.set_sync_debug_mode(0)
            cache = runner.spec_graphs if params is GREEDY else runner.spec_sampled_graphs
            replays = 0 if cache is None else sum(cache.replays.values())
            return [o.token_ids for o in outs], replays

    want, _ = asyncio.run(run(None))
    got, replays = asyncio.run(run(SPEC))
    assert got == want and replays > 0 and ks
    assert counts == dict(plain=0, spec=0)

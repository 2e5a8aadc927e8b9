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

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.api import assemble
from slipstream.params import SpeculativeConfig
from sync_device import SeparateMemoryDevice, check_runner, use_torch_paths

SPEC = SpeculativeConfig(num_drafts=3, adaptive=False)
BASE = dict(model="tiny-random", max_batch_size=4, max_num_batched_tokens=64, kv_cache_tokens=1024, page_size=8)
PROMPTS = [[5 + i, 9, 11, 40] * 6 for i in range(3)]  # repetitive: the n-gram drafter finds matches
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


def run_separate(monkeypatch, spec, depth=2, upload_delay_s=0.0, prompts=PROMPTS, params=GREEDY, **kw):
    """(token ids, stats, syncs, device) of `prompts` completed twice on a SeparateMemoryDevice, the
    second time (warm) under the sync detector."""
    devices = []
    monkeypatch.setattr(assemble, "make_device",
                        lambda *a, **k: devices.append(SeparateMemoryDevice(upload_delay_s=upload_delay_s))
                        or devices[-1])
    cfg = EngineConfig(**{**BASE, **kw}, speculative=spec, pipeline_depth=depth)

    async def go():
        async with Engine(cfg) as engine:
            device = devices[-1]
            check_runner(device, engine._parts.runner)
            await asyncio.gather(*(engine.complete(p, params) for p in prompts))  # warm: first-use allocations
            device.checking = True
            try:
                outs = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
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

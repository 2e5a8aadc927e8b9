"""Batched device sampling: the right distribution, filters, and noise keyed on (seed, position)
only — so a seeded request samples the same tokens alone, in a batch of 32, and at depth 1."""
import asyncio

import pytest
import torch

from invariance import invariant_config
from slipstream import Engine, SamplingParams
from slipstream.runtime.sampling.sampler import row_keys, uniforms
from slipstream.runtime.sampling.sampler import sample as sample_args
from slipstream.runtime.sampling.sampling_args import Draw, SamplingArgs, TopKTopP

RANDOM, GREEDY = True, False


def sample(logits, t, k, p, s, pos, random):
    """The sampler on a group whose SamplingArgs hold every random-row field (RANDOM) or none (GREEDY)."""
    return sample_args(logits, SamplingArgs(pos, draw=Draw(t, s, TopKTopP(k, p)) if random else None))


def rows(n, temperature=1.0, top_k=0, top_p=1.0, seed=0, start=0):
    return (torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int64), torch.full((n,), top_p),
            torch.full((n,), seed, dtype=torch.int64), torch.arange(start, start + n, dtype=torch.int64))


def test_uniforms_are_in_the_open_interval_and_well_spread():
    u = uniforms(row_keys(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)), 4096)
    assert 0 < u.min() and u.max() < 1
    # the extreme hashes too: a uniform of 1.0 is a noise of +inf, and a masked token's -inf + inf = NaN
    # is what argmax picks (a grammar violation once in 2**24 draws with 24-bit uniforms)
    import slipstream.runtime.sampling.sampler as sampler
    real, sampler.hash32 = sampler.hash32, lambda x: torch.full_like(x, 0xFFFFFFFF)
    try:
        top = uniforms(torch.zeros(1, dtype=torch.int64), 2)
    finally:
        sampler.hash32 = real
    assert top.max() < 1 and torch.isfinite(-(-top.log()).log()).all()
    assert abs(u.mean().item() - 0.5) < 0.005
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.003


def test_samples_follow_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5]).repeat(20_000, 1)
    t, k, p, s, pos = rows(20_000, seed=123)
    ids = sample(logits, t, k, p, s, pos, RANDOM)
    freq = torch.bincount(ids, minlength=5).float() / ids.numel()
    assert (freq - logits[0].softmax(-1)).abs().max() < 0.01


def test_temperature_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, -1.0, -2.0]).repeat(4000, 1)
    t, k, p, s, pos = rows(4000, top_k=2, seed=5)
    assert set(sample(logits, t, k, p, s, pos, RANDOM).tolist()) == {0, 1}
    t, k, p, s, pos = rows(4000, top_p=0.5, seed=6)
    assert set(sample(logits, t, k, p, s, pos, RANDOM).tolist()) <= {0, 1}
    t, k, p, s, pos = rows(4000, temperature=100.0, seed=7)
    assert len(set(sample(logits, t, k, p, s, pos, RANDOM).tolist())) == 6  # nearly uniform


def test_greedy_rows_take_the_argmax_beside_random_rows():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    t, k, p, s, pos = rows(8, seed=9)
    t[::2] = 0.0
    ids = sample(logits, t, k, p, s, pos, RANDOM)
    assert torch.equal(ids[::2], logits.argmax(-1)[::2])
    assert torch.equal(sample(logits, t * 0, k, p, s, pos, GREEDY), logits.argmax(-1))


def test_a_rows_tokens_do_not_depend_on_its_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 300, generator=g)
    t, k, p, _, pos = rows(32, temperature=0.9, top_k=40, top_p=0.95)
    seeds = torch.randint(0, 2**62, (32,), generator=g)
    together = sample(logits, t, k, p, seeds, pos, RANDOM)
    alone = torch.cat([sample(logits[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1], seeds[i:i + 1], pos[i:i + 1], RANDOM)
                       for i in range(32)])
    assert torch.equal(together, alone)
    shuffled = torch.randperm(32, generator=g)
    again = sample(logits[shuffled], t, k, p, seeds[shuffled], pos[shuffled], RANDOM)
    assert torch.equal(again, together[shuffled])


def cfg(depth):
    return invariant_config(model="tiny-random", pipeline_depth=depth, max_batch_size=32,  # alone == in a batch
                            max_num_batched_tokens=256, kv_cache_tokens=8192, page_size=8)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (40, 0.9)])
async def test_seeded_request_alone_in_a_batch_of_32_and_at_depth_1(top_k, top_p):
    target = ([7, 8, 9, 10], SamplingParams(max_tokens=24, temperature=0.8, top_k=top_k, top_p=top_p, seed=424242))
    others = [([3 + i, 40 + i], SamplingParams(max_tokens=20 + i % 5, temperature=0.0 if i % 3 else 1.0,
                                                seed=None if i % 2 else i)) for i in range(31)]
    async with Engine(cfg(2)) as engine:
        alone = (await engine.complete(*target)).token_ids
        batch = await asyncio.gather(*(engine.complete(*r) for r in others[:15]), engine.complete(*target),
                                     *(engine.complete(*r) for r in others[15:]))
        in_batch = batch[15].token_ids
    async with Engine(cfg(1)) as engine:
        depth1 = (await engine.complete(*target)).token_ids
    assert alone == in_batch == depth1
    assert len(set(alone)) > 3  # really sampled, not stuck on one token

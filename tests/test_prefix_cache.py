"""Prefix caching: the block hash, the refcounted pool, register-after-commit, and the engine's
outputs with caching on equal to off (tiny-random, batch_invariant) at depth 1 and 2.

Hypothesis runs shared prefixes × salts × aborts × preemption × tiny pools through the fake device
(tests/fake_runner.py), whose referee fails the run when a step writes a registered page or a page
is registered while an in-flight step writes it.
"""
import asyncio
import hashlib
import random
from array import array

import pytest

from engine_util import wait_all_free
from fake_runner import make_prompt
from invariance import invariant_config
from slipstream import Engine, InvalidRequestError, SamplingParams
from slipstream.errors import PipelineInvariantError
from slipstream.runtime.batch import ImageSpan, SamplingRow
from slipstream.scheduler.block_hash import block_hashes, salt_key
from slipstream.scheduler.page_pool import PagePool
from slipstream.scheduler.prefix_cache import PrefixCache
from slipstream.scheduler.sequence import ImageState, Sequence
from slipstream.serve import prefix_router
from test_pipeline_invariants import PAGE, check_results, run_workload

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


# --- the hash ------------------------------------------------------------------------------------

def test_block_hashes_chain_and_keep_the_router_bytes():
    ids = list(range(3, 40))
    prev, want = b"slipstream-prefix-v1", []  # the router's hash before it moved here
    for start in range(0, len(ids) - 8 + 1, 8):
        prev = hashlib.blake2b(prev + array("q", ids[start:start + 8]).tobytes(), digest_size=16).digest()
        want.append(prev)
    assert block_hashes(ids, 8) == want and len(want) == 4
    assert prefix_router.block_hashes is block_hashes  # one implementation
    changed = block_hashes([99] + ids[1:], 8)
    assert all(a != b for a, b in zip(changed, want))  # page 0 differs: every chained hash differs
    assert block_hashes(ids[:8] + [7] * 29, 8)[0] == want[0]


def test_a_salt_changes_every_hash():
    ids = list(range(3, 35))
    plain, a, b = (block_hashes(ids, 8, salt_key(s)) for s in (None, "a", "b"))
    assert plain == block_hashes(ids, 8)
    assert not set(plain) & set(a) and not set(a) & set(b)


def test_pages_inside_a_bidirectional_prefix_are_keyed_by_the_whole_prefix():
    """Moondream's BOS attends to the image after it: with pages of one token, BOS's page holds no
    image yet its K/V differs with the picture (issue 37, item 2). The engine's hashes equal these."""
    ids = [1] + [9] * 6 + list(range(20, 29))  # BOS, 6 placeholders, text
    a, b = (block_hashes(ids, 1, b"", [(1, 7, d)], bidirectional_len=7) for d in (b"A", b"B"))
    assert block_hashes(ids, 1, b"", [(1, 7, b"A")])[0] == block_hashes(ids, 1, b"", [(1, 7, b"B")])[0]
    assert a[0] != b[0] and not set(a) & set(b)
    seq = Sequence("s", ids, 1, SamplingRow(), images=ImageState([ImageSpan(1, 7, b"A", 6)]), bidirectional_len=7)
    cache = PrefixCache(PagePool(4), 1)
    cache.hashes(seq, 3)  # extended later, past the prefix's end
    assert cache.hashes(seq, 12) == a[:12]


@pytest.mark.parametrize("bad", [dict(cache_salt=""), dict(cache_salt=3), dict(cache_salt="x" * 257),
                                 dict(prefix_caching=1)])
def test_invalid_cache_fields_name_the_field(bad):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**bad)
    assert e.value.param == next(iter(bad))


# --- the pool ------------------------------------------------------------------------------------

def test_refcounts_lru_and_eviction():
    pool = PagePool(5)  # pages 1..4
    cache = PrefixCache(pool, PAGE)
    a, b = pool.allocate(2)
    pool.register(a)
    pool.register(b)
    cache._page_of.update({b"ha": a, b"hb": b})
    cache._hash_of.update({a: b"ha", b: b"hb"})
    pool.share(a)  # a second sequence maps page a
    pool.free([a, b])
    assert pool.refcount(a) == 1 and pool.refcount(b) == 0 and pool.num_free == 3
    assert list(pool.evictable) == [b]
    pool.free([a])
    assert list(pool.evictable) == [b, a] and pool.num_free == 4 and pool.num_held() == 0
    pool.share(b)  # a hit takes it back out of the LRU
    assert list(pool.evictable) == [a] and pool.num_free == 3
    got = pool.allocate(3)  # the never-cached pages first, then the least recently used cached one
    assert got[-1] == a and cache.stats().evictions == 1 and b"ha" not in cache._page_of
    assert cache.stats().cached_pages == 1
    with pytest.raises(PipelineInvariantError):
        pool.allocate(1)
    pool.free([b])
    with pytest.raises(PipelineInvariantError):
        pool.free([b])  # a double free
    with pytest.raises(PipelineInvariantError):
        pool.register(b)  # not held


# --- the scheduler with the fake device ------------------------------------------------------------

def shared_workload(rng, n, prefixes, salts=(b"",)):
    reqs = []
    for i in range(n):
        prefix = rng.choice(prefixes)
        tail = [3 + rng.randrange(200) for _ in range(rng.randint(0, 9))]
        abort = rng.choice([None, None, rng.randint(0, 60)])
        reqs.append((prefix + tail, rng.randint(1, 12), rng.randint(0, 40), abort, rng.choice(salts)))
    return reqs


def test_shared_prefixes_hit_the_cache_and_free_everything():
    prefixes = [make_prompt(17, None, 1), make_prompt(13, 4, 2)]
    reqs = [(p + [5 + i], 8, 30 * i, None) for i, p in enumerate(prefixes * 3)]
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs, prefix_caching=True))
        check_results(reqs, results, loop, pool)
        stats = loop.planner.prefix_cache.stats()
        assert stats.hits > 0 and stats.queries > stats.hits
        assert max(seq.prefix.num_cached_tokens for _, seq in results.values()) >= 12
        assert stats.cached_pages > 0 and pool.num_free == pool.total  # cached pages are evictable


def test_different_salts_never_share_a_page():
    prompt = make_prompt(21, None, 3)
    reqs = [(prompt, 6, 40 * i, None, salt) for i, salt in enumerate([b"A", b"B", b"A", None, b"B"])]
    salt_of = {}  # registered page -> the salt of the sequence that registered it
    shared = []

    def instrument(loop):
        cache, pages = loop.planner.prefix_cache, loop.planner.pages
        register, share = cache.register, pages.share

        def logged_register(seq):
            before = set(cache._hash_of)
            register(seq)
            for p in set(cache._hash_of) - before:
                salt_of[p] = seq.prefix.cache_extra

        def checked_share(seq, hit):
            assert all(salt_of[p] == seq.prefix.cache_extra for p in hit), "a page shared across salts"
            shared.extend(hit)
            share(seq, hit)

        cache.register, pages.share = logged_register, checked_share

    for depth in (1, 2):
        shared.clear()
        results, loop, pool = asyncio.run(run_workload(depth, reqs, prefix_caching=True, instrument=instrument))
        check_results(reqs, results, loop, pool)
        cached = [results[i][1].prefix.num_cached_tokens for i in range(5)]
        # the first of each salt computes its prefix, the second hits it; the opt-out (None) neither
        # hits nor registers
        assert cached[0] == cached[1] == cached[3] == 0 and cached[2] > 0 and cached[4] > 0
        assert shared and None not in salt_of.values()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n=st.integers(1, 10), depth=st.sampled_from([1, 2]),
       num_pages=st.integers(12, 40), max_batch=st.integers(1, 5), step_tokens=st.integers(5, 24),
       device_seed=st.integers(0, 2**16), salted=st.booleans())
def test_random_shared_prefixes_aborts_and_tiny_pools(seed, n, depth, num_pages, max_batch, step_tokens,
                                                      device_seed, salted):
    # 12 pages at least: the longest request (31 prompt + 12 output tokens) fits in the 11 usable
    # ones (the engine refuses a request larger than the pool at submission)
    rng = random.Random(seed)
    prefixes = [make_prompt(rng.randint(2, 22), rng.choice([None, rng.randint(0, 8)]), k) for k in range(3)]
    salts = (b"", b"t1", None) if salted else (b"",)
    reqs = shared_workload(rng, n, prefixes, salts)
    results, loop, pool = asyncio.run(run_workload(depth, reqs, num_pages, max_batch, step_tokens, device_seed,
                                                   prefix_caching=True))
    check_results(reqs, results, loop, pool)  # outputs = the reference (= depth 1), no leak, refcounts 0


def test_preempted_sequences_recompute_from_their_cached_prefix():
    reqs = [(make_prompt(10, None, s % 2) + [s], 12, s, None) for s in range(6)]
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs, num_pages=12, max_batch=4,
                                                       prefix_caching=True))
        assert loop.planner.num_preemptions > 0 and loop.planner.prefix_cache.stats().hits > 0
        check_results(reqs, results, loop, pool)


def test_cached_tokens_count_what_the_first_admission_found():
    """A preempted sequence is recomputed from its own pages, which it registered meanwhile: those hits
    are not the cache's gift to the request. usage.cached_tokens (OpenAI's, vLLM's) counts what its
    first admission found; these prompts are unique, so 0 each (it reported up to the whole prompt)."""
    reqs = [(make_prompt(10, None, 100 + s) + [s], 12, s, None) for s in range(6)]
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs, num_pages=10, max_batch=4, prefix_caching=True))
        check_results(reqs, results, loop, pool)
        assert any(seq.num_preemptions and seq.prefix.num_reused for _, seq in results.values()), "no recompute hit"
        assert [out.usage.cached_tokens for out, _ in results.values()] == [0] * len(reqs)


# --- the engine (tiny-random, batch_invariant) ------------------------------------------------------

def engine_cfg(depth, caching, **kw):
    base = dict(model="tiny-random", pipeline_depth=depth, max_batch_size=8, max_num_batched_tokens=32,
                kv_cache_tokens=1024, page_size=8, prefix_caching=caching)
    return invariant_config(**{**base, **kw})


def engine_requests():
    rng = random.Random(5)
    system = [rng.randrange(3, 259) for _ in range(45)]
    reqs = []
    for i in range(10):
        tail = [rng.randrange(3, 259) for _ in range(rng.randint(1, 12))]
        params = dict(max_tokens=rng.randint(2, 10), temperature=0.0)
        if i % 3 == 1:  # penalties: the history rebuilt on the first chunk after a hit
            params.update(repetition_penalty=1.3, frequency_penalty=0.5)
        reqs.append((system + tail, SamplingParams(**params)))
    return reqs


async def run_engine(depth, caching, reqs, **kw):
    computed = []
    async with Engine(engine_cfg(depth, caching, **kw)) as engine:
        engine.loop.observers.append(lambda step: computed.append(sum(w.num_tokens for w in step.chunks)))
        first = await engine.complete(*reqs[0])  # the prefix is cached once its pages commit
        rest = await asyncio.gather(*(engine.complete(p, s) for p, s in reqs[1:]))
        await wait_all_free(engine)
        cache = engine.loop.planner.prefix_cache
        assert engine.loop.planner.pool.num_held() == 0
        return [first, *rest], sum(computed), cache.stats() if cache else None


@pytest.mark.parametrize("depth", [1, 2])
async def test_engine_outputs_equal_with_caching_on_and_off(depth):
    reqs = engine_requests()
    off, computed_off, _ = await run_engine(depth, False, reqs)
    on, computed_on, stats = await run_engine(depth, True, reqs)
    assert [(o.token_ids, o.finish_reason) for o in on] == [(o.token_ids, o.finish_reason) for o in off]
    assert stats.hits >= 9 * 40 and computed_on <= computed_off - 9 * 40
    assert stats.cached_pages > 0


async def test_engine_cache_hits_survive_a_small_pool():
    reqs = engine_requests()
    off, _, _ = await run_engine(2, False, reqs, kv_cache_tokens=160)
    on, _, stats = await run_engine(2, True, reqs, kv_cache_tokens=160)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert stats.hits > 0


def test_the_last_known_token_is_always_recomputed():
    """A prompt of exactly two full pages, asked twice: the second reuses one page, not two (the
    last token's logits give its first output token)."""
    prompt = make_prompt(2 * PAGE, None, 4)
    reqs = [(prompt, 5, 0, None), (prompt, 5, 60, None)]
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs, prefix_caching=True))
        check_results(reqs, results, loop, pool)
        assert results[1][1].prefix.num_cached_tokens == PAGE


async def test_engine_salts_and_the_per_request_opt_out():
    prompt = list(range(3, 60))
    async with Engine(engine_cfg(2, True)) as engine:
        cache = engine.loop.planner.prefix_cache
        hits = []
        for kw in (dict(cache_salt="a"), dict(cache_salt="b"), dict(prefix_caching=False), dict(cache_salt="a"),
                   dict()):
            await engine.complete(prompt, SamplingParams(max_tokens=3, temperature=0.0, **kw))
            await wait_all_free(engine)
            hits.append(cache.stats().hits)
        assert hits[0] == hits[1] == hits[2] == 0  # a new salt, another salt, the opt-out
        assert hits[3] == 56 and hits[4] == 56  # salt "a" again; no salt has never been cached
        assert engine.loop.planner.pool.num_held() == 0

"""Images in the pipeline with the torch-free fake device (tests/fake_runner.py): encoder launches,
the encoder cache, the encoder budget, image rows sliced into chunks, image digests in the block hash.

The fake encoder turns an image's "pixels" into feature values that the fake forward writes into
the KV at the image's positions, so the reference output (`reference(..., images)`) is right only
if every image row got the right feature at the right position, at depth 1 and 2 alike.
"""
import asyncio
import hashlib
import random

import numpy as np
import pytest

from fake_clients import ended, serve_requests, submit_greedy
from fake_runner import EOS, FakeRunner, IMAGE, NullDetok, RefereedPool, RefereedRows, make_prompt, reference
from slipstream.outputs import CompletionOutput, RequestMetrics
from slipstream.params import SamplingParams
from slipstream.runtime.batch import ImageSpan, SamplingRow, image_slices
from slipstream.api.output_processor import OutputProcessor, RequestState
from slipstream.scheduler.block_hash import block_hashes, page_extra
from slipstream.scheduler.encoder_cache import EncoderCache
from slipstream.scheduler.engine_loop import EngineLoop
from slipstream.scheduler.planner import Planner
from slipstream.scheduler.sequence import ImageState, Sequence

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PAGE = 4


def image_prompt(length, eos_at, salt, images):
    """A fake prompt with images: `images` = [(offset >= 2, num_features, pixels)]; each image's
    placeholders are laid out as tiles of 2 with one text token between (positions not contiguous)."""
    prompt = make_prompt(length, eos_at, salt)
    spans, at = [], 0
    for offset, n, pixels in images:
        start = max(offset, at, 2)
        positions = [start + i + i // 2 for i in range(n)]  # x x . x x . x
        end = positions[-1] + 1
        prompt += [0] * max(0, end + 1 - len(prompt))  # grow the prompt to hold it (text token after)
        for p in range(start, end):
            prompt[p] = 3 + (p * 5 + salt) % 200
        for p in positions:
            prompt[p] = IMAGE
        digest = hashlib.sha256(repr(pixels).encode()).digest()
        spans.append(ImageSpan(start, end, digest, n, tuple(pixels), np.asarray(positions, np.int64)))
        at = end + 1
    prompt[1] = len(prompt)  # (the fake model reads the prompt length here)
    prompt[2:] = [t if t != 0 else 7 for t in prompt[2:]]
    return prompt, spans


def make_loop(depth, num_pages=64, max_batch=4, step_tokens=16, seed=0, prefix_caching=False,
              encoder_cache_tokens=64, max_encoder_tokens=16, duplicate_writes="random"):
    runner = FakeRunner(PAGE, seed=seed, duplicate_writes=duplicate_writes)
    pool = RefereedPool(num_pages, runner.referee)
    planner = Planner(pool, PAGE, max_batch, step_tokens, prefix_caching=prefix_caching,
                      encoder_cache_tokens=encoder_cache_tokens, max_encoder_tokens=max_encoder_tokens)
    planner.admission.free_rows = RefereedRows(planner.admission.free_rows, runner.referee)
    return EngineLoop(runner, planner, OutputProcessor(), depth, PAGE), pool


async def run_workload(depth, requests, instrument=None, **kw):
    """requests: (prompt, spans, max_tokens, arrive_after_yields, abort_after_yields | None)."""
    loop, pool = make_loop(depth, **kw)
    if instrument is not None:
        instrument(loop)

    def maker(i, prompt, spans, max_tokens):
        def make_seq():
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            req = RequestState(f"r{i}", prompt, params, NullDetok(), frozenset({EOS}), RequestMetrics(0.0))
            return Sequence(f"r{i}", prompt, max_tokens, SamplingRow(), user=req, images=ImageState(list(spans)) if spans else None)
        return make_seq

    jobs = [(maker(i, prompt, spans, max_tokens), arrive, abort_after)
            for i, (prompt, spans, max_tokens, arrive, abort_after) in enumerate(requests)]
    return await serve_requests(loop, jobs), loop, pool


def check_results(requests, results, loop, pool):
    runner, cache = loop.runner, loop.planner.encoder_cache
    for i, (prompt, spans, max_tokens, _, abort_after) in enumerate(requests):
        out, seq = results[i]
        want = reference(prompt, max_tokens, spans)
        if out.finish_reason == "abort":
            assert abort_after is not None
            assert out.token_ids == want[: len(out.token_ids)]
        else:
            assert out.token_ids == want, f"request {i}"
        assert (seq.images is None or not seq.images.held) and seq.row is None and not seq.pages
    assert runner.missing_features == 0, "a forward read an image row whose encoder output was gone"
    assert pool.num_free == pool.total and pool.num_held() == 0, "pages leaked"
    # no encoder-cache reference is left, and it is back within its bound (what is held is evictable)
    assert all(e.refs == 0 for e in cache._entries.values()), "encoder-cache references leaked"
    assert cache.features <= cache.max_features
    pending = set(cache.take_dropped())
    assert set(runner.features) - pending <= set(cache._entries), "the runner holds outputs the cache forgot"
    assert not loop.pipeline.inflight and not loop.planner.running


def pixels(k):
    return (k, k * 3 + 1, 7)


# --- units ------------------------------------------------------------------------------------------


def test_image_slices_split_an_image_between_chunks():
    span = ImageSpan(4, 11, b"d", 5, None, np.asarray([4, 5, 7, 8, 10]))
    first, second = image_slices([span], 0, 8), image_slices([span], 8, 20)
    assert first[0].token_index.tolist() == [4, 5, 7] and first[0].feature_index.tolist() == [0, 1, 2]
    assert second[0].token_index.tolist() == [0, 2] and second[0].feature_index.tolist() == [3, 4]
    assert image_slices([span], 11, 30) == [] and image_slices([span], 6, 7) == []


def test_encoder_cache_refcounts_and_lru():
    cache = EncoderCache(max_features=10)
    span = lambda d, n: ImageSpan(2, 2 + n, d, n)  # noqa: E731
    a = Sequence("a", [0] * 20, 1, SamplingRow(), images=ImageState([span(b"x", 6)]))
    b = Sequence("b", [0] * 20, 1, SamplingRow(), images=ImageState([span(b"y", 6)]))
    c = Sequence("c", [0] * 20, 1, SamplingRow(), images=ImageState([span(b"x", 6)]))
    cache.acquire(a)
    cache.acquire(b)  # 12 rows in use: over the bound, but nothing may be evicted
    assert cache.take_dropped() == [] and cache.features == 12
    cache.acquire(c)  # a hit on x
    cache.release(a)
    assert cache.in_use(b"x") and cache.take_dropped() == []
    cache.release(c)  # x unreferenced -> evicted (12 > 10), y stays (in use)
    assert cache.take_dropped() == [b"x"] and cache.in_use(b"y")
    assert (cache.hits, cache.misses, cache.evictions) == (1, 2, 1)
    cache.release(b)  # y unreferenced, 6 <= 10: kept for reuse
    assert cache.take_dropped() == [] and cache.stats().entries == 1


def test_page_extra_keeps_text_pages_and_keys_image_pages():
    ids = list(range(3, 23))
    plain = block_hashes(ids, 4, b"salt:a")
    with_img = block_hashes(ids, 4, b"salt:a", [(5, 9, b"D1")])
    other = block_hashes(ids, 4, b"salt:a", [(5, 9, b"D2")])
    assert with_img[0] == plain[0]  # page [0, 4) holds no image: same key (the router's too)
    assert with_img[1] != plain[1] and other[1] != with_img[1]
    assert other[2] != with_img[2]  # the chain carries the difference to every later page
    assert page_extra(b"", [(5, 9, b"D")], 8, 12) != page_extra(b"", [], 8, 12)
    assert block_hashes(ids, 4) == block_hashes(ids, 4, b"", ())


# --- the loop -----------------------------------------------------------------------------------------


def test_one_and_three_images_at_depth_1_and_2():
    one, s1 = image_prompt(12, None, 1, [(3, 5, pixels(1))])
    three, s3 = image_prompt(8, 3, 2, [(2, 3, pixels(2)), (4, 6, pixels(3)), (9, 4, pixels(4))])
    reqs = [(one, s1, 8, 0, None), (three, s3, 8, 2, None)]
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs))
        check_results(reqs, results, loop, pool)
        assert sorted(loop.runner.encodes) == sorted(s.digest for s in s1 + s3)


def test_a_prompt_chunked_through_an_image():
    prompt, spans = image_prompt(6, None, 3, [(3, 12, pixels(5))])  # the image spans 17 positions
    reqs = [(prompt, spans, 6, 0, None)]
    split = []

    def instrument(loop):
        launch = loop.runner.launch_forward

        def logged(step_id, packed, **kw):
            for w in packed.chunks:
                if w.images and 0 < len(w.images[0].feature_index) < 12:
                    split.append(w.images[0].feature_index.tolist())
            return launch(step_id, packed, **kw)

        loop.runner.launch_forward = logged

    for depth in (1, 2):
        split.clear()
        results, loop, pool = asyncio.run(run_workload(depth, reqs, instrument, step_tokens=5))
        check_results(reqs, results, loop, pool)
        assert len(split) >= 3 and sum(len(s) for s in split) == 12  # each feature fed once, in pieces
        assert loop.runner.encodes == [spans[0].digest]  # encoded once, sliced into every chunk


def test_a_repeated_image_does_not_rerun_the_encoder():
    a, sa = image_prompt(9, None, 4, [(2, 4, pixels(9))])
    b, sb = image_prompt(11, None, 5, [(5, 4, pixels(9))])  # same picture, elsewhere in another prompt
    reqs = [(a, sa, 5, 0, None), (b, sb, 5, 60, None)]
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs))
        check_results(reqs, results, loop, pool)
        assert loop.runner.encodes == [sa[0].digest]
        st_ = loop.planner.encoder_cache.stats()
        assert (st_.hits, st_.misses, st_.entries) == (1, 1, 1)


def test_the_encoder_budget_leaves_decode_rows_running():
    """A prompt with 3 images behind a decoding request: at most one image's encode per step (the
    budget), the prompt's chunks stop before an image that does not fit, and the decoding request
    is in every step meanwhile."""
    text = make_prompt(5, None, 6)
    heavy, spans = image_prompt(6, None, 7, [(2, 6, pixels(11)), (12, 6, pixels(12)), (22, 6, pixels(13))])
    reqs = [(text, [], 30, 0, None), (heavy, spans, 4, 12, None)]
    per_step = []

    def instrument(loop):
        launch = loop.runner.launch_encoder

        def logged(images):
            per_step.append([s.num_features for s in images])
            return launch(images)

        loop.runner.launch_encoder = logged
        plan = loop.planner.plan

        def checked(depth):
            step = plan(depth)
            if step is not None and any(w.images for w in step.chunks) and not results_done[0]:
                assert step.decode, "an image prefill starved the decode row"
            return step

        loop.planner.plan = checked

    for depth in (1, 2):
        per_step.clear()
        results_done = [False]
        results, loop, pool = asyncio.run(run_workload(depth, reqs, instrument, step_tokens=24,
                                                       max_encoder_tokens=8))
        check_results(reqs, results, loop, pool)
        assert per_step == [[6], [6], [6]]  # one image per step, never two (12 > 8)


def test_same_text_different_images_never_share_pages():
    """Prefix caching on: two requests with the same prompt ids and different images share no page;
    with the same image they do."""
    prompt, s1 = image_prompt(14, None, 8, [(2, 6, pixels(20))])
    _, s2 = image_prompt(14, None, 8, [(2, 6, pixels(21))])
    reqs = [(prompt, s1, 4, 0, None), (prompt, s2, 4, 80, None), (prompt, s1, 4, 160, None)]
    hits = {}

    def instrument(loop):
        admit = loop.planner.admission.admit

        def logged():
            seq = admit()
            if seq is not None:
                hits[seq.request_id] = seq.prefix.num_reused
            return seq

        loop.planner.admission.admit = logged

    for depth in (1, 2):
        hits.clear()
        results, loop, pool = asyncio.run(run_workload(depth, reqs, instrument, prefix_caching=True))
        check_results(reqs, results, loop, pool)
        # r1: same ids, other image: only the page before the image ([0, 4) holds no image row) hits
        assert hits["r1"] == 0 or hits["r1"] <= s1[0].start // PAGE * PAGE
        assert hits["r2"] > s1[0].end  # the same image: pages past it hit


# --- random workloads ----------------------------------------------------------------------------------

image = st.tuples(st.integers(2, 12), st.integers(1, 9), st.integers(0, 5))  # offset, features, which picture
request = st.tuples(
    st.integers(2, 16),  # text length
    st.one_of(st.none(), st.integers(0, 8)),  # EOS position
    st.lists(image, max_size=3),
    st.integers(1, 10),  # max_tokens
    st.integers(0, 40),  # arrival
    st.one_of(st.none(), st.integers(0, 60)),  # abort after
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=8), depth=st.sampled_from([1, 2]),
       num_pages=st.integers(14, 40), max_batch=st.integers(1, 5), step_tokens=st.integers(5, 24),
       device_seed=st.integers(0, 2**16), cache_tokens=st.integers(0, 24), encoder_budget=st.integers(1, 12),
       prefix_caching=st.booleans())
def test_random_images_aborts_preemption_tiny_pools_and_a_tiny_encoder_cache(
        reqs, depth, num_pages, max_batch, step_tokens, device_seed, cache_tokens, encoder_budget, prefix_caching):
    requests = []
    for salt, (n, eos, imgs, mt, arrive, abort) in enumerate(reqs):
        prompt, spans = image_prompt(n, eos, salt, [(o, f, pixels(k) + (f,)) for o, f, k in sorted(imgs)])
        if len(prompt) + mt > (num_pages - 1) * PAGE:
            continue
        requests.append((prompt, spans, mt, arrive, abort))
    if not requests:
        return
    results, loop, pool = asyncio.run(run_workload(
        depth, requests, num_pages=num_pages, max_batch=max_batch, step_tokens=step_tokens, seed=device_seed,
        encoder_cache_tokens=cache_tokens, max_encoder_tokens=encoder_budget, prefix_caching=prefix_caching))
    check_results(requests, results, loop, pool)


def test_preempted_sequences_with_images_recompute():
    reqs = []
    for s in range(6):
        prompt, spans = image_prompt(6, None, s, [(2, 5, pixels(s % 2))])
        reqs.append((prompt, spans, 12, s, None))
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs, num_pages=14, max_batch=4,
                                                       encoder_cache_tokens=5))
        assert loop.planner.num_preemptions > 0
        check_results(reqs, results, loop, pool)


def test_random_seeds_cover_chunk_splits():
    rng = random.Random(0)
    reqs = []
    for s in range(8):
        imgs = [(rng.randint(2, 8), rng.randint(1, 9), rng.randrange(4)) for _ in range(rng.randint(1, 3))]
        prompt, spans = image_prompt(rng.randint(3, 12), None, s, [(o, f, pixels(k) + (f,)) for o, f, k in sorted(imgs)])
        reqs.append((prompt, spans, rng.randint(1, 8), rng.randint(0, 30), rng.choice([None, rng.randint(0, 40)])))
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs, step_tokens=6, encoder_cache_tokens=8,
                                                       max_encoder_tokens=4))
        check_results(reqs, results, loop, pool)


@pytest.mark.parametrize("depth, b_late", [(1, False), (2, False), (1, True)])  # (2, True): b is in step 1, failed too
def test_a_failed_steps_encode_runs_again_for_the_next_user_of_the_image(depth, b_late):
    """The step carrying an image's first encode fails on the device (its encoder never ran): its
    request (a) fails, and the next request with the same picture (b) gets the image encoded again
    (`EncoderCache.unlaunch` in the loop's recovery), never a hit on an output that does not exist.
    b waits in the queue (one row), or, with two rows, arrives while a's failed step is in flight.
    (A request admitted without a chunk in the failed step: the test below, for its page entries.)"""
    from slipstream.errors import StepFailedError

    a, sa = image_prompt(6, None, 11, [(2, 4, pixels(21))])
    b, sb = image_prompt(30, None, 12, [(24, 4, pixels(21))])  # same picture, after 24 text tokens
    assert sa[0].digest == sb[0].digest
    failed_at = []

    async def run():
        loop, pool = make_loop(depth, max_batch=2 if b_late else 1, step_tokens=8)
        launch = loop.runner._launch_encodes

        def fail_first_encode(step_id):
            if not failed_at and sa[0].digest in [s.digest for s in loop.runner._encodes]:
                failed_at.append(step_id)
                loop.runner.fail_steps.add(step_id)
            return launch(step_id)

        loop.runner._launch_encodes = fail_first_encode
        task = asyncio.create_task(loop.run())
        seqs = []
        for i, (prompt, spans) in enumerate([(a, sa), (b, sb)]):
            while b_late and i == 1 and not failed_at:
                await asyncio.sleep(0)
            req = RequestState(f"r{i}", prompt, SamplingParams(max_tokens=5, temperature=0.0), NullDetok(),
                               frozenset({EOS}), RequestMetrics(0.0))
            seqs.append(Sequence(f"r{i}", prompt, 5, SamplingRow(), user=req, images=ImageState(list(spans)) if spans else None))
            loop.submit(seqs[-1])

        async def result(seq):
            while True:
                item = await seq.user.queue.get()
                if isinstance(item, (CompletionOutput, StepFailedError)):
                    return item

        outs = await asyncio.wait_for(asyncio.gather(*(result(s) for s in seqs)), 30)
        loop.close()
        await task
        return outs, loop, pool

    (out_a, out_b), loop, pool = asyncio.run(run())
    assert failed_at and loop.failed_steps >= 1
    assert isinstance(out_a, StepFailedError), out_a
    assert isinstance(out_b, CompletionOutput), out_b  # b had no chunk in the failed step
    assert out_b.token_ids == reference(b, 5, sb)
    assert loop.runner.missing_features == 0, "b's image rows found no encoder output"
    assert loop.runner.encodes == [sa[0].digest, sa[0].digest]  # the failed encode, then b's
    assert pool.num_free == pool.total
    assert all(e.refs == 0 for e in loop.planner.encoder_cache._entries.values())


@pytest.mark.parametrize("depth", [1, 2])
def test_a_failed_step_keeps_the_page_writes_of_a_request_it_did_not_carry(depth):
    """A request admitted in a step that gives it no chunk (the encoder budget cut it right at its
    image, where its prefix-cache hit ends) still has its page-table entries in that step. When the
    step fails, the request is not failed (it is in no failed step) and its entries must reach the
    device with a later step: the soak of 2026-11-25 (4 mismatches) ran it on the row's previous
    owner's pages, writing its K/V into pages the prefix cache (and others) held.
    r0, r1 fill both rows first; t takes the step's encoder budget; s's hit (r1's first page) ends at
    its image; v repeats r1 and reads r1's cached pages afterwards."""
    from slipstream.errors import StepFailedError

    s, ss = image_prompt(16, None, 41, [(4, 4, pixels(42))])  # its image starts right after the hit page
    r1 = s[:4] + [3 + (i * 13) % 200 for i in range(12)]  # same first page as s, text only
    r0 = [s[0] + 1, 16] + [5 + (i * 7) % 200 for i in range(14)]  # another first page
    t, st = image_prompt(12, None, 43, [(2, 4, pixels(44))])
    failed_at, steps = [], {}

    async def run():
        loop, pool = make_loop(depth, max_batch=2, step_tokens=16, prefix_caching=True, max_encoder_tokens=4)
        launch = loop.runner._launch_encodes

        def fail_ts_encode(step_id):
            if not failed_at and st[0].digest in [x.digest for x in loop.runner._encodes]:
                failed_at.append(step_id)
                loop.runner.fail_steps.add(step_id)
            return launch(step_id)

        loop.runner._launch_encodes = fail_ts_encode
        loop_launch = loop.launch

        def logged(step):  # which requests each step carries, and which rows its page writes are for
            loop_launch(step)
            steps[step.step_id] = ({q.request_id for q in step.seqs}, set(step.page_writes[::3]),
                                   {q.request_id: q.row for q in loop.planner.running})
            return step

        loop.launch = logged
        task = asyncio.create_task(loop.run())

        outs = {}
        for group in ([("r0", r0, []), ("r1", r1, [])], [("t", t, st), ("s", s, ss)], [("v", r1, [])]):
            seqs = [submit_greedy(loop, *g) for g in group]  # (no yield between: admitted by the same plan)
            for (name, *_), item in zip(group, await asyncio.wait_for(asyncio.gather(*map(ended, seqs)), 30)):
                outs[name] = item
        loop.close()
        await task
        return outs, loop, pool

    outs, loop, pool = asyncio.run(run())
    assert failed_at and isinstance(outs["t"], StepFailedError), outs["t"]
    carried, written, rows = steps[failed_at[0]]
    assert "s" not in carried and rows["s"] in written, "the failed step must hold s's entries, not s"
    assert outs["r0"].token_ids == reference(r0, 4) and outs["r1"].token_ids == reference(r1, 4)
    if not (depth == 2 and isinstance(outs["s"], StepFailedError)):  # (at depth 2 s may have a chunk in the step behind)
        assert isinstance(outs["s"], CompletionOutput), outs["s"]
        assert outs["s"].token_ids == reference(s, 4, ss), "s ran on pages its row's previous owner held"
    assert outs["v"].token_ids == reference(r1, 4), "v read cached pages another request overwrote"
    assert pool.num_free == pool.total

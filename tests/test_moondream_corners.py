"""Where Moondream's bidirectional prefix meets the other features (issue 37): prefix caching with
pages of one token, a step budget close to the prefix, usage.cached_tokens, and the encoder cache's
counts and salt. The tiny random folder and its float64 oracle are tests/test_moondream_engine.py's."""
import asyncio

import pytest

from slipstream import Engine, InvalidRequestError, SamplingParams
from test_moondream_engine import GREEDY, IMAGE, OTHER, QUESTIONS, check, config, md, run_engine, want  # noqa: F401

pytest.importorskip("PIL.Image")
pytest.importorskip("tokenizers")


def test_one_token_pages_never_share_the_bos_page_across_images(md, want):  # noqa: F811
    """With page_size 1 the BOS page holds no image, but BOS attends to the image: a request with
    another picture must not hit it (it got cached_tokens=1 and logprobs 4.7e-3 off)."""
    (first, second, same), _ = run_engine(config(md[0], 1, page_size=1, prefix_caching=True), [
        [(QUESTIONS[0], IMAGE)], [(QUESTIONS[0], OTHER)], [(QUESTIONS[1], IMAGE)]])
    check(first[0], want[(QUESTIONS[0], "image")])
    check(second[0], want[(QUESTIONS[0], "other")])
    assert second[0].usage.cached_tokens == 0
    check(same[0], want[(QUESTIONS[1], "image")])
    assert same[0].usage.cached_tokens >= 17  # the same picture still hits its whole prefix


def test_the_encoder_cache_is_keyed_by_the_cache_salt(md):  # noqa: F811
    """Two tenants (salts) with one picture each encode it; the same salt again is a hit, with prefix
    caching off too (the salt isolates the encoder cache whatever the pages do)."""
    async def run():
        async with Engine(config(md[0], 1)) as engine:
            for salt, caching in (("a", True), ("b", True), ("a", True), ("b", False), (None, False)):
                params = SamplingParams(max_tokens=2, temperature=0.0, cache_salt=salt, prefix_caching=caching)
                await engine.complete(QUESTIONS[0], params, images=[IMAGE])
            return await engine.stats()
    stats = asyncio.run(run())
    # a, b, unsalted: misses; b again: a hit; a again: its pages (image included) from the prefix cache
    assert (stats["encoder_cache_misses"], stats["encoder_cache_hits"]) == (3, 1)


@pytest.mark.parametrize("budget", [17, 18])
def test_no_image_request_waits_for_a_decode_batch_to_end(md, budget):  # noqa: F811
    """Two rows, a 17-token prefix: a budget of 17 leaves 16 tokens beside one decoding row, so the
    second request's prefix never fit until the first request ended (its first token came after the
    other's last). Such a budget is refused by name; the smallest one allowed admits the prefix."""
    async def run():
        async with Engine(config(md[0], 1, max_batch_size=2, max_num_batched_tokens=budget)) as engine:
            order = []

            async def long():
                params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
                async for _ in engine.stream(QUESTIONS[0], params, images=[IMAGE]):
                    started.set()
                order.append("long")

            started = asyncio.Event()
            task = asyncio.create_task(long())
            await asyncio.wait({task, asyncio.ensure_future(started.wait())}, return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                task.result()  # (a refusal)
            await engine.complete(QUESTIONS[1], SamplingParams(max_tokens=1, temperature=0.0), images=[OTHER])
            order.append("short")
            await task
            return order

    if budget == 17:
        with pytest.raises(InvalidRequestError, match="max_num_batched_tokens >= 18") as err:
            asyncio.run(run())
        assert err.value.param == "images"
    else:
        assert asyncio.run(run()) == ["short", "long"]

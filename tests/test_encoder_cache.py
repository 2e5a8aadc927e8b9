"""The encoder cache where it meets the prefix cache and the cache salt (issue 37, item 5): an image
whose pages all came from the prefix cache is neither encoded nor counted nor kept, and entries are
keyed by the image's digest and the request's cache salt (one tenant cannot time another's picture)."""
import asyncio

from fake_clients import ended, submit_greedy
from fake_runner import reference
from slipstream.runtime.batch import ImageSpan, SamplingRow
from slipstream.scheduler.block_hash import image_key
from slipstream.scheduler.encoder_cache import EncoderCache
from slipstream.scheduler.sequence import ImageState, Sequence
from test_images_pipeline import image_prompt, make_loop, pixels


def test_an_image_before_the_first_chunk_is_not_acquired():
    cache = EncoderCache(max_features=0)
    spans = [ImageSpan(2, 6, b"x", 4), ImageSpan(9, 13, b"y", 4)]
    seq = Sequence("a", [0] * 20, 1, SamplingRow(), images=ImageState(spans))
    cache.acquire(seq, start=8)  # a prefix-cache hit of 8 tokens holds x's rows already
    assert not cache.in_use(b"x") and cache.in_use(b"y")
    assert (cache.hits, cache.misses, cache.stats().entries) == (0, 1, 1)
    cache.release(seq)
    assert cache.stats().entries == 0 and cache.take_dropped() == [b"y"]


def test_the_cache_salt_keys_the_image():
    d = bytes(range(32))
    assert image_key(d, None) == d  # unsalted requests keep the picture's digest (and share it)
    a, b = image_key(d, "a"), image_key(d, "b")
    assert len(a) == len(d) and len({d, a, b}) == 3 and image_key(d, "a") == a


def test_a_repeat_served_from_the_prefix_cache_neither_encodes_nor_misses():
    """The repeat's hit covers the whole image (the entry was evicted meanwhile): it counted a second
    miss for one encode and kept an entry for outputs that never existed."""
    prompt, spans = image_prompt(20, None, 7, [(3, 4, pixels(5))])  # image in positions 3..8, 3 pages hit

    async def run():
        loop, pool = make_loop(1, prefix_caching=True, encoder_cache_tokens=0)
        task = asyncio.create_task(loop.run())
        outs = []
        for name in ("a", "b"):
            seq = submit_greedy(loop, name, prompt, spans)
            outs.append((await asyncio.wait_for(ended(seq), 30), seq))
        loop.close()
        await task
        return outs, loop

    outs, loop = asyncio.run(run())
    (a, _), (b, seq_b) = outs
    assert a.token_ids == b.token_ids == reference(prompt, 4, spans)
    assert seq_b.prefix.num_reused >= spans[0].end, "the repeat's hit did not cover its image: no scenario"
    stats = loop.planner.encoder_cache.stats()
    assert loop.runner.encodes == [spans[0].digest] and (stats.misses, stats.hits) == (1, 0)
    assert stats.entries == 0 and stats.features == 0

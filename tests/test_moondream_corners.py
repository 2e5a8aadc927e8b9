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

"""Depth 2 == depth 1 on the default model for 32 mixed, staggered requests; a subset == transformers."""
import asyncio
import random

import pytest

from engine_util import run_staggered, wait_all_free
from invariance import invariant_config
from slipstream import Engine, SamplingParams

TOPICS = ["the ocean", "a small robot", "prime numbers", "Paris in spring", "how bread is made", "the moon",
          "a chess opening", "volcanoes", "the history of tea", "binary search", "a rainy day", "owls"]


def requests_32(seed=7):
    rng = random.Random(seed)
    reqs = []
    for i in range(32):
        topic = rng.choice(TOPICS)
        words = " ".join(rng.choice(TOPICS) for _ in range(rng.randint(0, 30)))  # mixed prompt lengths
        prompt = f"<|im_start|>user\nWrite about {topic}. {words}<|im_end|>\n<|im_start|>assistant\n"
        kind = i % 4
        if kind == 0:  # plain: the transformers subset
            params = SamplingParams(max_tokens=rng.randint(8, 24), temperature=0.0, ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, stop=[".", "\n"])
        elif kind == 2:
            params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0, stop_token_ids=[28, 30])
        else:
            params = SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0)  # EOS allowed
        reqs.append((prompt, params, rng.random() * 0.5))
    return reqs


async def run(depth, reqs):
    async with Engine(invariant_config(model="smollm2-135m", pipeline_depth=depth, max_batch_size=32)) as engine:
        outs = await run_staggered(engine, reqs)
        return outs, await wait_all_free(engine)


@pytest.fixture(scope="module")
def both_depths():
    reqs = requests_32()
    return reqs, {d: asyncio.run(run(d, reqs)) for d in (1, 2)}


def test_depth2_equals_depth1(both_depths):
    reqs, res = both_depths
    one, two = res[1][0], res[2][0]
    for (prompt, params, _), a, b in zip(reqs, one, two):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), prompt
    reasons = {o.finish_reason for o in one}
    assert reasons == {"stop", "length"}
    for depth in (1, 2):
        stats = res[depth][1]
        assert stats["kv_pages_free"] == stats["kv_pages_total"] and stats["running"] == 0


def test_stop_strings_truncate_text(both_depths):
    reqs, res = both_depths
    for (prompt, params, _), out in zip(reqs, res[2][0]):
        for s in params.stop:
            assert s not in out.text


def test_subset_equals_transformers_greedy(both_depths, hf_model, loaded):
    import torch

    reqs, res = both_depths
    subset = [(r, o) for r, o in zip(reqs, res[2][0]) if r[1].ignore_eos][:6]
    assert len(subset) == 6
    for (prompt, params, _), out in subset:
        ids = loaded.tokenizer.encode(prompt)
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([ids]), max_new_tokens=params.max_tokens, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == want

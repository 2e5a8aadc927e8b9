"""The draft-model drafter (SpeculativeConfig(method="draft"), speculation/draft_model_drafter.py) on the tiny
random model, drafting for itself: greedy output with speculation equals the output without it at
depth 1 and 2, with full context (nearly every draft accepted) and with a 2-token context (drafts
rejected often); a draft model whose vocabulary or tokenizer differs is refused by name."""
import asyncio
from dataclasses import replace

import pytest
from invariance import invariant_config

from slipstream import Engine, InvalidRequestError, SamplingParams
from slipstream.api.assemble import check_draft_model
from slipstream.models.config import tiny_config
from slipstream.params import SpeculativeConfig

PROMPTS = [[5, 9, 77, 3, 101], [200, 17, 17, 40, 8, 9, 33, 12, 250, 6, 6], [42]]


def generate(depth, spec=None, max_tokens=20, prompts=PROMPTS):
    config = invariant_config(model="tiny-random", pipeline_depth=depth, max_batch_size=4, kv_cache_tokens=256,
                              page_size=8, speculative=spec)

    async def run():
        async with Engine(config) as engine:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            outs = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
            return [o.token_ids for o in outs], (await engine.stats()).get("speculative")

    return asyncio.run(run())


@pytest.mark.parametrize("depth", [1, 2])
def test_draft_model_output_equals_plain_decoding(depth):
    plain, _ = generate(depth)
    full, stats = generate(depth, SpeculativeConfig(method="draft", draft_model="tiny-random", adaptive=False))
    assert full == plain
    assert stats["drafted"] > 0 and stats["acceptance_rate"] > 0.9  # the same model: its drafts are its tokens
    short, stats = generate(depth, SpeculativeConfig(method="draft", draft_model="tiny-random", draft_context=2,
                                                     adaptive=False))
    assert short == plain
    assert stats["accepted"] < stats["drafted"]  # (rejections happened)


def test_a_draft_model_dearer_than_its_drafts_is_run_rarely():
    # the tiny model drafting for itself is always right, but a proposal (a prefill and three
    # one-token steps of the same model) costs several of its forwards: measured on the first
    # speculating step, after which the adaptive policy stops drafting (probes aside)
    plain, _ = generate(2, max_tokens=80, prompts=PROMPTS[:1])
    out, stats = generate(2, SpeculativeConfig(method="draft", draft_model="tiny-random"), 80, PROMPTS[:1])
    assert out == plain
    # (in the cost table's unit, where a one-position forward is 6.0: a proposal costs several)
    assert stats["draft_cost"] is not None and stats["draft_cost"] > 6.0
    assert 0 < stats["steps"] <= 3  # (unpriced, this row would draft on most of its ~20 steps)


def test_draft_model_with_another_vocabulary_or_tokenizer_is_refused():
    class Tok:
        def __init__(self, shift=0):
            self.shift = shift

        def encode(self, text):
            return [ord(c) + self.shift for c in text]

    target = tiny_config()
    check_draft_model(target, Tok(), tiny_config(), Tok())
    for draft, tok in ((replace(target, vocab_size=600), Tok()), (target, Tok(1))):
        with pytest.raises(InvalidRequestError) as e:
            check_draft_model(target, Tok(), draft, tok)
        assert e.value.param == "speculative.draft_model"
    for fields in (dict(method="draft"), dict(method="ngram", draft_model="tiny-random"),
                   dict(method="draft", draft_model="")):
        with pytest.raises(InvalidRequestError) as e:
            SpeculativeConfig(**fields)
        assert e.value.param == "speculative.draft_model"

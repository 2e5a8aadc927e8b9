"""Penalties, min_p, min_tokens and top_logprobs end to end, through the engine's row tables.

References come from the engine's own outputs: top_logprobs are the raw distribution, so a greedy
run with presence/frequency penalties must pick, at every step, the argmax of (raw logprob −
penalty) over its alternatives (the penalty is additive, and logits and logprobs differ by one
constant per row). The math itself is checked against transformers in test_logits_process.py.
"""
import asyncio

import pytest
from engine_util import wait_all_free

from slipstream import Engine, EngineConfig, SamplingParams

CFG = dict(model="tiny-random", max_batch_size=8, max_num_batched_tokens=64, kv_cache_tokens=4096, page_size=8,
           batch_invariant=True)
PROMPT = [5, 9, 11, 40, 40, 7, 300, 12]


def reference_choice(alternatives: dict[int, float], counts: dict[int, int], presence: float, frequency: float) -> int:
    scores = {t: lp - presence * (counts.get(t, 0) > 0) - frequency * counts.get(t, 0) for t, lp in alternatives.items()}
    best = max(scores, key=scores.get)
    # a token outside the alternatives has a raw logprob below all of them and a penalty >= 0
    assert scores[best] >= min(alternatives.values()), "the reference needs more alternatives"
    return best


@pytest.mark.parametrize("depth", [1, 2])
async def test_presence_and_frequency_penalties_pick_the_penalised_argmax(depth):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=0.5, logprobs=True, top_logprobs=20)
    async with Engine(EngineConfig(pipeline_depth=depth, **CFG)) as engine:
        plain = await engine.complete(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        out = await engine.complete(PROMPT, params)
        await wait_all_free(engine)
    assert len(out.top_logprobs) == len(out.token_ids) == 24
    counts: dict[int, int] = {}
    for token, alternatives in zip(out.token_ids, out.top_logprobs):
        assert len(alternatives) == 20 and list(alternatives.values()) == sorted(alternatives.values(), reverse=True)
        assert token == reference_choice(alternatives, counts, 1.5, 0.5)
        counts[token] = counts.get(token, 0) + 1
    assert out.token_ids != plain.token_ids  # the penalty changed the output
    assert len(set(plain.token_ids)) < len(set(out.token_ids))  # ...towards fewer repeats


async def test_top_logprobs_start_with_the_greedy_token_and_its_logprob():
    async with Engine(EngineConfig(**CFG)) as engine:
        out = await engine.complete(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                           top_logprobs=3))
    assert out.logprobs is not None and len(out.top_logprobs) == 8
    for token, lp, alternatives in zip(out.token_ids, out.logprobs, out.top_logprobs):
        first = next(iter(alternatives))
        assert len(alternatives) == 3 and first == token and alternatives[first] == pytest.approx(lp, abs=1e-6)


async def test_repetition_penalty_counts_the_prompt_and_the_output():
    async with Engine(EngineConfig(**CFG)) as engine:
        out = await engine.complete(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                           repetition_penalty=100.0))
    seen = set(PROMPT)
    for token in out.token_ids:  # a seen token's logit is crushed: an unseen one always wins here
        assert token not in seen
        seen.add(token)


async def test_min_tokens_holds_back_stop_ids_and_min_p_one_is_greedy():
    async with Engine(EngineConfig(**CFG)) as engine:
        greedy = await engine.complete(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        first = greedy.token_ids[0]
        stopped = await engine.complete(PROMPT, SamplingParams(max_tokens=6, temperature=0.0,
                                                               stop_token_ids=[first]))
        held = await engine.complete(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[first],
                                                            min_tokens=3))
        sampled = await engine.complete(PROMPT, SamplingParams(max_tokens=6, temperature=1.0, seed=3, min_p=1.0,
                                                               ignore_eos=True))
        await wait_all_free(engine)
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
    assert sampled.token_ids == greedy.token_ids  # min_p = 1 keeps only the most likely token


async def test_a_penalised_request_gives_the_same_tokens_alone_and_in_a_mixed_batch():
    penalised = SamplingParams(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True, frequency_penalty=0.7,
                               repetition_penalty=1.3, min_p=0.05)
    others = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=1.0, seed=2, ignore_eos=True, presence_penalty=-1.0)]
    async with Engine(EngineConfig(**CFG)) as engine:
        alone = await engine.complete(PROMPT, penalised)
        mixed = await asyncio.gather(engine.complete(PROMPT, penalised),
                                     *(engine.complete([3 + i] * (4 + i), p) for i, p in enumerate(others * 3)))
        await wait_all_free(engine)
    assert mixed[0].token_ids == alone.token_ids

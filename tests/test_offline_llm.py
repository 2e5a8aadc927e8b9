"""The synchronous `LLM` API: same outputs as the async Engine, typed errors, closed means closed."""
import asyncio

import pytest

from invariance import INVARIANT
from slipstream import LLM, Engine, EngineConfig, InvalidRequestError, SamplingParams
from slipstream.errors import EngineClosedError

# LLM.generate batches what the reference runs one by one: the comparison needs invariance
CFG = dict(model="tiny-random", max_batch_size=8, max_num_batched_tokens=64, kv_cache_tokens=2048, page_size=8,
           **INVARIANT)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello", "the sky is", [5, 6, 7, 8]]


def test_generate_matches_the_async_engine_and_keeps_order():
    async def reference():
        async with Engine(EngineConfig(**CFG)) as engine:
            return [(await engine.complete(p, GREEDY)).token_ids for p in PROMPTS]

    want = asyncio.run(reference())
    with LLM(EngineConfig(**CFG)) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == want
        assert [o.token_ids for o in llm.generate(PROMPTS[0], GREEDY)] == want[:1]  # one prompt: a list of one
        assert [o.token_ids for o in llm.generate(PROMPTS[2], GREEDY)] == want[2:]  # token ids are one prompt
        per_prompt = llm.generate(PROMPTS[:2], [GREEDY, SamplingParams(max_tokens=3, temperature=0.0)])
        assert len(per_prompt[1].token_ids) <= 3
        assert llm.stats()["running"] == 0


def test_errors_are_typed_and_a_closed_llm_refuses():
    llm = LLM(**CFG)
    with pytest.raises(InvalidRequestError):
        llm.generate("x", {"max_tokens": 2})  # params must be a SamplingParams
    with pytest.raises(InvalidRequestError):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(InvalidRequestError):
        llm.chat([{"role": "user"}])
    llm.close()
    llm.close()  # idempotent
    with pytest.raises(EngineClosedError):
        llm.generate("x")


def test_callable_from_a_thread_that_runs_its_own_event_loop():
    with LLM(**CFG) as llm:
        async def inside_a_loop():
            return llm.generate("hi", GREEDY)  # blocks this loop's thread; the engine runs on its own

        assert len(asyncio.run(inside_a_loop())[0].token_ids) == 10

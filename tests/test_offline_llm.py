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


# --- issue 27, defect 6: no request outlives a generate() that raised --------------------------
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def _idle(llm):
    """Nothing running or waiting at once; the pages of steps still in flight back soon after."""
    import time

    s = llm.stats()
    if s["running"] or s["waiting"]:
        return False
    deadline = time.monotonic() + 5
    while s["kv_pages_free"] != s["kv_pages_total"] and time.monotonic() < deadline:
        time.sleep(0.01)
        s = llm.stats()
    return s["kv_pages_free"] == s["kv_pages_total"]


def test_one_bad_prompt_in_a_batch_runs_none_of_them():
    with LLM(**CFG) as llm:
        steps = llm.stats()["steps"]
        with pytest.raises(InvalidRequestError) as e:  # a bad type: refused before any is submitted
            llm.generate(["a"] * 20 + [[5, None]] + ["b"] * 20, LONG)
        assert e.value.param == "prompts[20]"
        assert llm.stats()["steps"] == steps
        with pytest.raises(InvalidRequestError) as e:  # too long: refused at its submission; the rest aborted
            llm.generate(["a"] * 20 + [[5] * 5000] + ["b"] * 20, LONG)
        assert _idle(llm), llm.stats()
        assert len(llm.generate("hi", GREEDY)[0].token_ids) == 10


def test_an_interrupted_generate_aborts_what_it_submitted():
    import signal
    import threading
    import time

    def ctrl_c():  # a real signal: it wakes the blocked wait, as a terminal's Ctrl-C does
        while llm.stats()["steps"] < 10:  # (a few steps in, however fast the machine decodes)
            time.sleep(0.002)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # Python keeps SIGINT ignored when it started so (a background job of a script): ask for Ctrl-C's
    # usual handler, as a terminal's Python has
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    with LLM(**CFG) as llm:
        interrupter = threading.Thread(target=ctrl_c, daemon=True)
        interrupter.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(["tell me a story"] * 40, LONG)
        finally:
            interrupter.join(timeout=5)
            signal.signal(signal.SIGINT, handler)
        assert llm.stats()["steps"] < 150  # interrupted well before the first 200 tokens
        assert _idle(llm), llm.stats()
        assert len(llm.generate("hi", GREEDY)[0].token_ids) == 10


@pytest.mark.parametrize("prompts", [None, 5, 2.5, {"prompt": "x"}])
def test_generate_refuses_what_is_not_a_prompt(prompts):
    with LLM(**CFG) as llm:
        with pytest.raises(InvalidRequestError):
            llm.generate(prompts, GREEDY)


def test_llm_refuses_a_config_that_is_not_an_engine_config():
    import threading

    before = threading.active_count()
    with pytest.raises(InvalidRequestError) as e:
        LLM({"model": "tiny-random"})
    assert e.value.param == "config" and threading.active_count() == before

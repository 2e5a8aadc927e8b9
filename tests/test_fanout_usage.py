"""SamplingParams.n (one request, n completions; slipstream/api/fanout.py) and the usage block of
every CompletionOutput, through Engine, LLM and the worker Client."""
import asyncio

import msgspec
import pytest
from engine_util import wait_all_free

from slipstream import LLM, Engine, EngineConfig, InvalidRequestError, SamplingParams, Usage
from slipstream.api.fanout import child_params, child_seed, fan_out
from slipstream.outputs import CompletionOutput, RequestMetrics

CFG = dict(model="tiny-random", max_batch_size=8, max_num_batched_tokens=64, kv_cache_tokens=2048, page_size=8)


def test_child_seeds_are_reproducible_distinct_and_keep_the_first():
    seeds = [child_seed(42, i) for i in range(64)]
    assert seeds[0] == 42 and len(set(seeds)) == 64
    assert seeds == [child_seed(42, i) for i in range(64)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert child_seed(43, 1) != child_seed(42, 1)
    p = child_params(SamplingParams(n=3, seed=7, max_tokens=5), 2)
    assert (p.n, p.seed, p.max_tokens) == (1, child_seed(7, 2), 5)
    assert child_params(SamplingParams(n=3), 1).seed is None  # unseeded children each draw their own


def test_usage_is_filled_for_every_output_and_survives_the_wire():
    out = CompletionOutput("r", "ab", [1, 2, 3], "length", [9, 9], RequestMetrics(0.0))
    assert out.usage == Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=CompletionOutput)
    assert back.usage == out.usage and back.index == 0


async def test_a_failing_child_cancels_its_siblings():
    started, cancelled = [], []

    async def run(params, rid):
        started.append(rid)
        if rid == "x-1":
            raise InvalidRequestError("no", param="max_tokens")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(rid)
            raise

    with pytest.raises(InvalidRequestError):
        await fan_out(run, SamplingParams(n=3), "x")
    assert started == ["x-0", "x-1", "x-2"] and sorted(cancelled) == ["x-0", "x-2"]


async def test_seeded_n_gives_reproducible_distinct_completions():
    async with Engine(EngineConfig(**CFG)) as engine:
        p = SamplingParams(n=3, seed=1234, temperature=1.0, max_tokens=12, ignore_eos=True)
        outs = await engine.complete("once upon", p, request_id="story")
        again = await engine.complete("once upon", p)
        alone = await engine.complete("once upon", SamplingParams(seed=1234, temperature=1.0, max_tokens=12,
                                                                  ignore_eos=True))
        assert isinstance(alone, CompletionOutput)  # n=1: one output, as before
        assert [o.index for o in outs] == [0, 1, 2]
        assert [o.request_id for o in outs] == ["story-0", "story-1", "story-2"]
        assert [o.token_ids for o in outs] == [o.token_ids for o in again]
        assert len({tuple(o.token_ids) for o in outs}) == 3
        assert outs[0].token_ids == alone.token_ids  # choice 0 keeps the request's seed
        for o in outs:
            assert o.usage == Usage(prompt_tokens=len(o.prompt_token_ids), completion_tokens=12, total_tokens=len(
                o.prompt_token_ids) + 12)
        chats = await engine.chat([{"role": "user", "content": "hi"}], p)
        assert [o.index for o in chats] == [0, 1, 2]
        await wait_all_free(engine)


async def test_usage_counts_the_stop_token_and_stops_short():
    async with Engine(EngineConfig(**CFG)) as engine:
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        first = (await engine.complete([5, 6, 7], greedy)).token_ids
        out = await engine.complete([5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                              stop_token_ids=[first[2]]))
        assert out.finish_reason == "stop" and out.token_ids == first[:3]
        assert out.usage == Usage(prompt_tokens=3, completion_tokens=3, total_tokens=6)


async def test_n_is_refused_on_streams_and_skills():
    async with Engine(EngineConfig(**CFG)) as engine:
        with pytest.raises(InvalidRequestError) as e:
            [d async for d in engine.stream("x", SamplingParams(n=2))]
        assert e.value.param == "n"
        with pytest.raises(InvalidRequestError) as e:  # a skill returns one dict
            await engine.point("a photo", "cat", params=SamplingParams(n=2))
        assert e.value.param == "n"
        assert (await engine.stats())["running"] == 0


async def test_a_child_id_in_use_fails_the_request_and_frees_the_others():
    async with Engine(EngineConfig(**CFG)) as engine:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        busy = asyncio.create_task(engine.complete("x", long, request_id="job-1"))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidRequestError):
            await engine.complete("y", SamplingParams(n=3, max_tokens=200, ignore_eos=True), request_id="job")
        assert (await engine.stats())["running"] <= 1
        busy.cancel()
        await asyncio.gather(busy, return_exceptions=True)
        await wait_all_free(engine)


async def test_cancelling_an_n_request_aborts_every_child():
    async with Engine(EngineConfig(**CFG)) as engine:
        task = asyncio.create_task(engine.complete("y", SamplingParams(n=4, max_tokens=300, ignore_eos=True)))
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_all_free(engine)


def test_llm_generate_puts_n_outputs_in_the_prompts_place():
    with LLM(**CFG) as llm:
        outs = llm.generate(["a", "b"], [SamplingParams(n=2, seed=3, max_tokens=4), SamplingParams(max_tokens=4)])
        assert isinstance(outs[0], list) and [o.index for o in outs[0]] == [0, 1]
        assert isinstance(outs[1], CompletionOutput) and outs[1].usage.completion_tokens <= 4


class _CharDetok:
    """Token t is the character chr(t): enough for the output processor's stop logic."""

    def push(self, ids):
        return "".join(map(chr, ids))

    def flush(self):
        return ""


def _run_processor(params, tokens, tops=None):
    from slipstream.api.output_processor import OutputProcessor
    from slipstream.api.request_stream import RequestState
    from slipstream.runtime.batch import SamplingRow
    from slipstream.scheduler.sequence import Sequence

    def finish(seq, reason):
        if seq.finished:
            return False
        seq.finished, seq.finish_reason = True, reason
        return True

    proc = OutputProcessor()
    proc.bind(finish)
    req = RequestState("r", [1, 2], params, _CharDetok(), frozenset(), RequestMetrics(0.0))
    seq = Sequence("r", [1, 2], params.max_tokens, SamplingRow(), user=req)
    for i, t in enumerate(tokens):
        if not seq.finished:
            proc.accept([seq], [t], [-0.5], None if tops is None else [tops[i]])  # the tick
            proc.process_pending()  # the output stage
    return req.output


async def test_stop_strings_wait_for_min_tokens_and_top_logprobs_reach_the_output():
    text = [ord(c) for c in "abXcdXef"]
    out = _run_processor(SamplingParams(max_tokens=8, stop=["X"]), text)
    assert (out.text, out.finish_reason) == ("ab", "stop")
    out = _run_processor(SamplingParams(max_tokens=8, stop=["X"], min_tokens=4), text)
    assert (out.text, out.finish_reason) == ("abXcd", "stop")  # the first X came before the 4th token
    out = _run_processor(SamplingParams(max_tokens=8, stop=["X"], min_tokens=3), text)
    assert (out.text, out.token_ids) == ("ab", text[:3])  # X is the 3rd token: min_tokens reached, it stops
    tops = [{t: -0.5, 7: -2.0} for t in text[:3]]
    out = _run_processor(SamplingParams(max_tokens=3, top_logprobs=2), text[:3], tops)
    assert out.top_logprobs == tops and out.logprobs == [-0.5] * 3 and out.usage.completion_tokens == 3
    assert _run_processor(SamplingParams(max_tokens=3), text[:3]).top_logprobs is None


def test_http_rendering_of_top_logprobs_and_n_usage():
    from slipstream.serve import render

    class Tok:
        def decode(self, ids):
            return "".join(chr(96 + t) for t in ids)

    a = CompletionOutput("r-0", "ab", [1, 2], "length", [5, 5, 5], RequestMetrics(0.0), logprobs=[-0.1, -0.2],
                         top_logprobs=[{1: -0.1, 3: -2.5}, {2: -0.2, 4: -1.9}])
    b = CompletionOutput("r-1", "c", [3], "stop", [5, 5, 5], RequestMetrics(0.0), logprobs=[-0.3],
                         top_logprobs=[{3: -0.3, 1: -1.0}], index=1)
    chat = render.chat("r", 0, "m", [a, b], [render.chat_logprobs(Tok(), o) for o in (a, b)])
    assert chat["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    first = chat["choices"][0]["logprobs"]["content"][0]
    assert (first["token"], first["logprob"]) == ("a", -0.1)
    assert [(t["token"], t["logprob"]) for t in first["top_logprobs"]] == [("a", -0.1), ("c", -2.5)]
    legacy = render.completion_logprobs(Tok(), a)
    assert legacy["top_logprobs"] == [{"a": -0.1, "c": -2.5}, {"b": -0.2, "d": -1.9}]
    plain = CompletionOutput("p", "a", [1], "length", [5], RequestMetrics(0.0), logprobs=[-0.1])
    assert render.chat_logprobs(Tok(), plain)["content"][0]["top_logprobs"] == []
    assert render.completion_logprobs(Tok(), plain)["top_logprobs"] is None


def test_a_stop_string_found_a_pass_late_cuts_the_tokens_committed_after_it():
    """The output stage may see a stop string after the tick committed more tokens of the request
    (depth 2 keeps sampling until the sequence is finished): the output ends at the stop anyway."""
    from slipstream.api.output_processor import OutputProcessor
    from slipstream.api.request_stream import RequestState
    from slipstream.runtime.batch import SamplingRow
    from slipstream.scheduler.sequence import Sequence

    ended = []
    proc = OutputProcessor()
    proc.bind(lambda seq, reason: ended.append(reason) or setattr(seq, "finished", True) or True)
    params = SamplingParams(max_tokens=20, stop=["X"], logprobs=True)
    req = RequestState("r", [1], params, _CharDetok(), frozenset(), RequestMetrics(0.0))
    seq = Sequence("r", [1], 20, SamplingRow(), user=req)
    for t in [ord(c) for c in "abXcde"]:  # six commits before the stage runs once
        proc.accept([seq], [t], [-0.25])
    assert not seq.finished  # a stop string is the stage's to find
    proc.process_pending()
    out = req.output
    assert (out.text, out.finish_reason, ended) == ("ab", "stop", ["stop"])
    assert out.token_ids == [ord(c) for c in "abX"] and out.logprobs == [-0.25] * 3
    assert len(out.metrics.token_times) == 3

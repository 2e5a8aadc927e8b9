"""Every public entry type-checks what it receives: InvalidRequestError naming the field, at the call.

Each case below passed validation (or raised an untyped TypeError/AttributeError/KeyError/...)
before; some corrupted or killed the engine from inside the tick.
"""
import asyncio

import pytest

from slipstream import Engine, EngineConfig, InvalidRequestError, SamplingParams
from slipstream.errors import WrongEventLoopError

BAD_PARAMS = [
    (dict(seed=1.5, temperature=0.8), "seed"),
    (dict(top_k=2.5, temperature=0.8), "top_k"),
    (dict(stop=[b"\n"]), "stop[0]"),
    (dict(stop=["ok", 1]), "stop[1]"),
    (dict(top_p=None), "top_p"),
    (dict(top_p="0.5"), "top_p"),
    (dict(top_k=None), "top_k"),
    (dict(stop=123), "stop"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=["a"]), "stop_token_ids[0]"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids[0]"),
    (dict(seed="42"), "seed"),
    (dict(best_of=2), "'best_of'"),  # an unknown keyword
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(logprobs="yes"), "logprobs"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(temperature=1e-45), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(stop=["\ud800"]), "stop[0]"),
    (dict(choice=["a", 3]), "choice[1]"),
    (dict(regex=5), "regex"),
]


@pytest.mark.parametrize("kwargs,field", BAD_PARAMS, ids=[repr(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert field in str(e.value)
    if not field.startswith("'"):  # (an unknown keyword has no field of its own)
        assert e.value.param == field  # what the HTTP server reports as OpenAI's "param"


def test_openai_style_nones_mean_none():
    p = SamplingParams(stop=None, stop_token_ids=None, seed=None)
    assert p.stop == () and p.stop_token_ids == () and p.seed is None
    assert SamplingParams(stop="x").stop == ("x",)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_batch_size="8"), "max_batch_size"), (dict(pipeline_depth=True), "pipeline_depth"),
    (dict(kv_cache_tokens=1.5), "kv_cache_tokens"), (dict(trace="yes"), "trace"),
    (dict(step_timeout_s=0), "step_timeout_s"), (dict(modle="x"), "'modle'"), (dict(model=None), "model"),
    (dict(output_stage="process"), "output_stage"),
])
def test_bad_engine_config_raises_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as e:
        EngineConfig(**kwargs)
    assert field in str(e.value)


@pytest.fixture(scope="module")
def engine_cfg():
    return EngineConfig(model="tiny-random", max_batch_size=4, max_num_batched_tokens=32, kv_cache_tokens=1024,
                        page_size=8, max_model_len=64)


BAD_CALLS = [
    (dict(prompt=None), "prompt"),
    (dict(prompt=123), "prompt"),
    (dict(prompt=b"hello"), "prompt"),
    (dict(prompt=[True, False]), "prompt[0]"),
    (dict(prompt=[3, 1.5]), "prompt[1]"),
    (dict(prompt=[3, 10**9]), "prompt[1]"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt="hi \udc80"), "prompt"),
    (dict(params={"max_tokens": 4}), "params"),
    (dict(request_id=7), "request_id"),
    (dict(params=SamplingParams(max_tokens=60)), "max_tokens"),  # prompt + max_tokens > max_model_len
]

BAD_MESSAGES = [
    ("hello", "messages"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    (["hi"], "messages[0]"),
    ([], "messages"),
]


async def test_engine_entries_reject_bad_input_and_keep_serving(engine_cfg):
    async with Engine(engine_cfg) as engine:
        for kwargs, field in BAD_CALLS:
            call = dict(prompt="hello world", params=SamplingParams(max_tokens=4, temperature=0.0))
            call.update(kwargs)
            with pytest.raises(InvalidRequestError) as e:
                await engine.complete(call["prompt"], call["params"], request_id=call.get("request_id"))
            assert field in str(e.value), (kwargs, str(e.value))
            with pytest.raises(InvalidRequestError):
                async for _ in engine.stream(call["prompt"], call["params"], request_id=call.get("request_id")):
                    pass
        for messages, field in BAD_MESSAGES:
            with pytest.raises(InvalidRequestError) as e:
                await engine.chat(messages, SamplingParams(max_tokens=2))
            assert field in str(e.value), (messages, str(e.value))
        out = await engine.complete("hello", SamplingParams(max_tokens=3, temperature=0.0, stop=None, seed=None))
        assert len(out.token_ids) == 3
        assert (await engine.stats())["running"] == 0


async def test_one_bad_stop_no_longer_kills_the_engine_for_everyone(engine_cfg):
    async with Engine(engine_cfg) as engine:
        good = asyncio.create_task(engine.complete("abc", SamplingParams(max_tokens=8, temperature=0.0)))
        with pytest.raises(InvalidRequestError):
            await engine.complete("abc", SamplingParams(max_tokens=8, stop=["ok", 1]))
        assert len((await good).token_ids) == 8
        assert len((await engine.complete("later", SamplingParams(max_tokens=2))).token_ids) == 2


async def test_auto_request_ids_never_collide_with_user_ids(engine_cfg):
    async with Engine(engine_cfg) as engine:
        p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        users = [asyncio.create_task(engine.complete("x", p, request_id=f"req-{i}")) for i in range(3)]
        autos = [asyncio.create_task(engine.complete("y", p)) for _ in range(3)]
        outs = await asyncio.gather(*users, *autos)
        assert len({o.request_id for o in outs}) == 6


async def test_breaking_out_of_a_stream_frees_its_request_id_at_once(engine_cfg):
    async with Engine(engine_cfg) as engine:
        p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        async for _ in engine.stream("x", p, request_id="mine"):
            break
        # no loop pass in between: the id is free and the request aborted
        assert "mine" not in engine.submitter.requests
        out = await engine.complete("x", SamplingParams(max_tokens=2), request_id="mine")
        assert out.request_id == "mine"


def test_an_engine_called_from_another_event_loop_raises(engine_cfg):
    import threading

    started, done = threading.Event(), threading.Event()
    box = {}

    def owner():
        async def main():
            async with Engine(engine_cfg) as engine:
                box["engine"] = engine
                started.set()
                while not done.is_set():
                    await asyncio.sleep(0.01)
        asyncio.run(main())

    t = threading.Thread(target=owner)
    t.start()
    try:
        assert started.wait(30)
        with pytest.raises(WrongEventLoopError):
            asyncio.run(asyncio.wait_for(box["engine"].complete("x", SamplingParams(max_tokens=2)), 5))
    finally:
        done.set()
        t.join(30)

"""One input, one error, whichever door it comes through (issue 37, item 11): the in-process Engine,
a Client talking to a worker, the synchronous LLM and the HTTP server refuse the same input with the
same error type and the same `param` (HTTP: the same field of its own request body)."""
import asyncio

import msgspec
import pytest
from image_util import encoded
from worker_util import engine_config, worker  # noqa: F401 (fixture)

from slipstream import LLM, Client, Engine, SamplingParams
from slipstream.errors import InvalidRequestError
from slipstream.images import ImageLimits

HUGE = "x" * 2_000_000  # over EngineConfig.max_prompt_chars (1,000,000)
TOO_MANY = [encoded()] * (ImageLimits().max_images + 1)


def forced_stop() -> SamplingParams:
    params = SamplingParams(max_tokens=2)
    msgspec.structs.force_setattr(params, "stop", ["ok", 1])  # behind the frozen Struct's back
    return params


CASES = {  # name -> (prompt, params, images, param every door names)
    "huge prompt": (HUGE, SamplingParams(max_tokens=2), (), "prompt"),
    "forced stop": ("hi", forced_stop(), (), "stop[1]"),
    "too many images": ("hi", SamplingParams(max_tokens=2), TOO_MANY, f"images[{ImageLimits().max_images}]"),
}


async def _refusal(call) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        await asyncio.wait_for(call(), 30)
    return info.value


async def test_engine_and_client_refuse_alike(worker):  # noqa: F811
    async with Engine(engine_config()) as engine, Client(worker.address, timeout=10) as client:
        for name, (prompt, params, images, param) in CASES.items():
            kw = {"images": images} if images else {}
            here = await _refusal(lambda: engine.complete(prompt, params, **kw))
            there = await _refusal(lambda: client.complete(prompt, params, **kw))
            assert (type(here), here.param) == (type(there), there.param) == (InvalidRequestError, param), \
                (name, here, there)
            assert "image" not in str(there) or images, (name, str(there))  # no "1 of them images"


def test_llm_names_the_prompt_of_the_list():
    with LLM(engine_config()) as llm:
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(["hi", HUGE], SamplingParams(max_tokens=2))
        assert info.value.param == "prompts[1]"
        with pytest.raises(InvalidRequestError) as info:  # too long in tokens, found once tokenized
            llm.generate(["hi", "y" * 5000], SamplingParams(max_tokens=2))
        assert info.value.param == "prompts[1]"
        with pytest.raises(InvalidRequestError) as info:
            llm.generate(["hi"], [forced_stop()])
        assert info.value.param == "stop[1]"


def test_http_names_the_same_fields():
    pytest.importorskip("fastapi")
    from serve_util import ThreadServer, httpx

    from slipstream.serve import EngineBackend

    with ThreadServer(EngineBackend(engine_config())) as server:
        for body, param in [({"prompt": HUGE}, "prompt"), ({"prompt": "hi", "stop": ["ok", 1]}, "stop[1]")]:
            r = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

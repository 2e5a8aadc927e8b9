"""Images end to end over HTTP (issue 30, must-show 3): the official `openai` client sends a PNG as a
data URL to `slipstream serve` running the tiny random Idefics3 folder and gets the tokens the
in-process `Engine.chat` gives for the same messages and image; a bad image is a 400 naming the part."""
import asyncio

import pytest
from image_util import data_url, png
from serve_util import ThreadServer

from idefics3_fixture import idefics3_folder  # noqa: F401 (fixture)
from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.serve import EngineBackend

openai = pytest.importorskip("openai")
from openai import AsyncOpenAI  # noqa: E402

MAX_TOKENS = 12




PICTURES = [png(100, 150, 7), png(64, 40, 8)]


def messages(*urls):
    """A two-turn chat: the first image in the first user turn, any second one in the last."""
    first = [{"type": "image_url", "image_url": {"url": urls[0]}}, {"type": "text", "text": "What is it?"}]
    last = [{"type": "text", "text": "And this"}] + [{"type": "image_url", "image_url": {"url": u}}
                                                     for u in urls[1:]] + [{"type": "text", "text": "?"}]
    return [{"role": "user", "content": first}, {"role": "assistant", "content": "A cat."},
            {"role": "user", "content": last}]


def config(folder) -> EngineConfig:
    return EngineConfig(model=str(folder), max_batch_size=4, max_num_batched_tokens=64, kv_cache_tokens=2048,
                        page_size=8, batch_invariant=True, seed=0)


CASES = {"one image": [data_url(PICTURES[0])], "two images": [data_url(p) for p in PICTURES]}


@pytest.fixture(scope="module")
def reference(idefics3_folder):  # noqa: F811
    """The in-process engine's greedy answers (batch invariant: the server's batching cannot change them)."""
    async def run():
        async with Engine(config(idefics3_folder)) as engine:
            greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            return {name: await engine.chat(messages(*urls), greedy) for name, urls in CASES.items()}
    return asyncio.run(run())


@pytest.fixture(scope="module")
def server(idefics3_folder):  # noqa: F811
    with ThreadServer(EngineBackend(config(idefics3_folder))) as s:
        yield s


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("case", list(CASES))
async def test_openai_client_image_answer_equals_the_engine(server, reference, case):
    want = reference[case]
    assert len(want.token_ids) == MAX_TOKENS and want.text
    async with client(server) as oa:
        r = await oa.chat.completions.create(model="tiny-idefics3", messages=messages(*CASES[case]),
                                             max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        chunks = [c async for c in await oa.chat.completions.create(
            model="tiny-idefics3", messages=messages(*CASES[case]), max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body={"ignore_eos": True})]
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)  # the image placeholders were expanded alike
    assert r.usage.completion_tokens == MAX_TOKENS
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text


async def test_openai_client_answers_differ_with_the_image(server, reference):
    """Guards the comparison above: the image does reach the model (another picture, another answer)."""
    async with client(server) as oa:
        r = await oa.chat.completions.create(model="m", messages=messages(data_url(png(100, 150, 99))),
                                             max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content != reference["one image"].text


@pytest.mark.parametrize("bad, words", [
    (data_url(b"this is not an image"), "not an image"),
    (data_url(PICTURES[0][: len(PICTURES[0]) // 2]), "truncated"),
    (data_url(PICTURES[0], media="text/plain"), "image/"),
])
async def test_openai_client_bad_image_is_a_400_naming_the_part(server, reference, bad, words):
    field = "messages[2].content[1].image_url.url"  # the last turn: text, image, text
    async with client(server) as oa:
        with pytest.raises(openai.BadRequestError) as e:
            await oa.chat.completions.create(model="m", messages=messages(data_url(PICTURES[0]), bad),
                                             max_tokens=4, temperature=0)
        # nothing else is affected: the next request with good images answers as before
        r = await oa.chat.completions.create(model="m", messages=messages(*CASES["two images"]),
                                             max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == field and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(field + ": ") and words in err["message"], err["message"]
    assert r.choices[0].message.content == reference["two images"].text

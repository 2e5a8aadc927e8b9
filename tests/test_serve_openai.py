"""`slipstream serve` (in-process engine) driven by the official OpenAI client over real HTTP on loopback."""
import asyncio
import json

import pytest
from serve_util import ThreadServer, wait_pages_free
from worker_util import engine_config

from slipstream import Engine, SamplingParams
from slipstream.serve import EngineBackend
from slipstream.serve.sse import parse

httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
from openai import AsyncOpenAI  # noqa: E402

PROMPTS = [f"client {i} says hello" for i in range(200)]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
          "required": ["colour", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    with ThreadServer(EngineBackend(engine_config())) as s:
        yield s


@pytest.fixture(scope="module")
def reference():
    """Greedy outputs of an in-process Engine with the server's settings (batch invariant: order-free)."""
    async def run():
        async with Engine(engine_config()) as engine:
            greedy = SamplingParams(max_tokens=8, temperature=0.0)
            outs = await asyncio.gather(*(engine.complete(p, greedy) for p in PROMPTS))
            chat = await engine.chat(CHAT, SamplingParams(max_tokens=12, temperature=0.0))
            deltas = [(d.text, d.finish_reason) async for d in engine.stream(
                await engine.chat_prompt(CHAT), SamplingParams(max_tokens=12, temperature=0.0)) if d.text or d.finish_reason]
            return {"completions": [o.text for o in outs], "chat": chat, "chat_deltas": deltas}
    return asyncio.run(run())


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)


async def test_completion_usage_and_request_id_match_the_engine(server, reference):
    async with client(server) as oa:
        raw = await oa.completions.with_raw_response.create(model="tiny-random", prompt=PROMPTS[0], max_tokens=8,
                                                            temperature=0)
        r = raw.parse()
    assert r.choices[0].text == reference["completions"][0]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == len(PROMPTS[0].encode())
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert raw.headers["x-request-id"] == r.id and r.id.startswith("cmpl-")


async def test_chat_streamed_and_not(server, reference):
    want = reference["chat"]
    async with client(server) as oa:
        r = await oa.chat.completions.create(model="m", messages=CHAT, max_tokens=12, temperature=0)
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
        assert r.choices[0].finish_reason == want.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
        chunks = [c async for c in await oa.chat.completions.create(
            model="m", messages=CHAT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in content) == want.text
    finishes = [c.choices[0].finish_reason for c in content]
    assert finishes[-1] == want.finish_reason and all(f is None for f in finishes[:-1])
    # one chunk per engine delta, finish_reason riding on the last content chunk (no empty extra chunk).
    # How many tokens a delta carries depends on when the output stage ran, so the boundaries may
    # differ from the reference stream's; the text and the shape may not.
    deltas = [(c.choices[0].delta.content, c.choices[0].finish_reason) for c in content[1:]]
    assert all(text for text, _ in deltas[:-1]) and deltas[-1][1] == reference["chat_deltas"][-1][1]
    assert "".join(text or "" for text, _ in deltas) == "".join(text for text, _ in reference["chat_deltas"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


async def test_completion_stream_without_usage(server, reference):
    async with client(server) as oa:
        chunks = [c async for c in await oa.completions.create(model="m", prompt=PROMPTS[3], max_tokens=8,
                                                              temperature=0, stream=True)]
    assert "".join(c.choices[0].text for c in chunks) == reference["completions"][3]
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks)


async def test_response_format_json_schema_validates(server):
    async with client(server) as oa:
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
        r = await oa.chat.completions.create(model="m", messages=CHAT, max_tokens=60, temperature=0, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        # json_object: any object; a random model rarely closes one, so only its start is checked
        r = await oa.chat.completions.create(model="m", messages=CHAT, max_tokens=4, temperature=0,
                                             response_format={"type": "json_object"})
        assert r.choices[0].message.content.startswith("{")


async def test_extra_body_regex_and_choice(server):
    async with client(server) as oa:
        r = await oa.completions.create(model="m", prompt="Pick:", max_tokens=8, temperature=0,
                                        extra_body={"choice": ["yes", "no"]})
        assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
        r = await oa.completions.create(model="m", prompt="Code:", max_tokens=8, temperature=0,
                                        extra_body={"regex": "[0-9]{3}"})
        assert len(r.choices[0].text) == 3 and r.choices[0].text.isdigit()


async def test_extra_body_grammar_skill(server):
    from slipstream.grammar import parse_skill_output

    async with client(server) as oa:
        r = await oa.completions.create(model="m", prompt="Point at the cat.", max_tokens=40, temperature=0,
                                        extra_body={"grammar": {"kind": "point", "value": "cat", "max_objects": 2}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    points = parse_skill_output("point", r.choices[0].text)["points"]
    assert len(points) <= 2 and all(0 <= p["x"] <= 1 and 0 <= p["y"] <= 1 for p in points)


async def test_stop_string_cuts_the_output(server, reference):
    full = reference["completions"][5]
    stop = full[3]  # a character greedy decoding produces: the output must end just before it
    async with client(server) as oa:
        r = await oa.completions.create(model="m", prompt=PROMPTS[5], max_tokens=8, temperature=0, stop=[stop])
        s = [c async for c in await oa.completions.create(model="m", prompt=PROMPTS[5], max_tokens=8,
                                                         temperature=0, stop=stop, stream=True)]
    assert r.choices[0].text == full[: full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in s) == r.choices[0].text and s[-1].choices[0].finish_reason == "stop"


async def test_logprobs(server):
    async with client(server) as oa:
        r = await oa.completions.create(model="m", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=0)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == 6 and all(x <= 0 for x in lp.token_logprobs)
        assert "".join(lp.tokens) == r.choices[0].text or len(lp.tokens) == 6
        c = await oa.chat.completions.create(model="m", messages=CHAT, max_tokens=5, temperature=0, logprobs=True)
        content = c.choices[0].logprobs.content
        assert len(content) == c.usage.completion_tokens and all(t.logprob <= 0 for t in content)
        off = await oa.chat.completions.create(model="m", messages=CHAT, max_tokens=5, temperature=0)
        assert off.choices[0].logprobs is None


async def test_seed_reproducible(server):
    async with client(server) as oa:
        def req(seed):
            return oa.completions.create(model="m", prompt=PROMPTS[2], max_tokens=16, temperature=1.0, seed=seed)
        a, b, c = await asyncio.gather(req(7), req(7), req(8))
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text  # 16 tokens at T=1 from a random model: a collision is ~impossible


async def test_n_choices_with_summed_usage(server):
    async with client(server) as oa:
        one = await oa.completions.create(model="m", prompt="count", max_tokens=6, temperature=1.0, seed=5,
                                          extra_body={"ignore_eos": True})
        r = await oa.completions.create(model="m", prompt="count", max_tokens=6, temperature=1.0, seed=5, n=3,
                                        extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.choices[0].text == one.choices[0].text  # choice 0 keeps the seed
        assert len({c.text for c in r.choices}) == 3
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (one.usage.prompt_tokens, 18)
        assert r.usage.total_tokens == r.usage.prompt_tokens + 18
        chat = await oa.chat.completions.create(model="m", messages=CHAT, max_tokens=5, n=2, temperature=0,
                                                logprobs=True)
        assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content == \
            chat.choices[1].message.content  # greedy: n identical answers
        assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)


@pytest.mark.parametrize("kw, param", [
    ({"max_tokens": "many"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 3.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 2, "stream": True}, "n"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"extra_body": {"min_tokens": 9}}, "min_tokens"),  # > max_tokens
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"extra_body": {"top_k": "x"}}, "top_k"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"extra_body": {"regex": "(unclosed"}}, "regex"),
    ({"extra_body": {"regex": "a", "choice": ["b"]}}, "choice"),
    ({"logprobs": True, "stream": True}, "logprobs"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"max_completion_tokens": 5000}, "max_completion_tokens"),
])
async def test_bad_parameters_are_400_naming_the_field(server, kw, param):
    async with client(server) as oa:
        with pytest.raises(openai.BadRequestError) as e:
            limit = {} if "max_completion_tokens" in kw else {"max_tokens": 4}
            r = await oa.chat.completions.create(model="m", messages=CHAT, **{**limit, **kw})
            if kw.get("stream"):
                [c async for c in r]
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error"
    assert e.value.body["param"] is not None and e.value.body["param"].startswith(param), e.value.body
    assert e.value.body["message"]


async def test_bad_body_shapes(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.post("/v1/chat/completions", json={"messages": [{"content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
        r = await http.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await http.post("/v1/completions", json={"prompt": [1, 100000], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    async with client(server) as oa, httpx.AsyncClient(base_url=server.url) as http:
        total = (await http.get("/health")).json()["stats"]["kv_pages_total"]
        stream = await oa.completions.create(model="m", prompt=PROMPTS[4], max_tokens=1000, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        stats = (await http.get("/health")).json()["stats"]
        assert stats["running"] == 1 and stats["kv_pages_free"] < total  # still generating when we leave
        await stream.close()
    stats = await wait_pages_free(server.url, timeout=1.0)  # finishing 1000 tokens would take seconds
    assert stats["kv_pages_free"] == total


async def test_disconnect_while_waiting_non_streamed_aborts(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True},
                            timeout=0.5)
    await wait_pages_free(server.url, timeout=1.0)


async def test_health_metrics_models_tokenize(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        h = (await http.get("/health")).json()
        assert h["status"] == "ok" and h["stats"]["kv_pages_total"] > 0
        m = (await http.get("/metrics")).text
        assert "slipstream_ttft_seconds_count" in m and "slipstream_kv_pages_free" in m
        assert 'slipstream_http_requests_total{endpoint="completions",status="200"}' in m
        ids = (await http.post("/tokenize", json={"prompt": "héllo"})).json()
        assert ids["count"] == len("héllo".encode()) == len(ids["tokens"])
        assert (await http.post("/detokenize", json={"tokens": ids["tokens"]})).json()["prompt"] == "héllo"
        chat_ids = (await http.post("/tokenize", json={"messages": CHAT})).json()
        assert chat_ids["count"] > ids["count"]
    async with client(server) as oa:
        assert [m.id for m in (await oa.models.list()).data] == ["tiny-random"]


async def test_200_concurrent_streams_equal_in_process_greedy(server, reference):
    async with client(server) as oa:
        async def one(prompt):
            chunks = [c async for c in await oa.completions.create(model="m", prompt=prompt, max_tokens=8,
                                                                  temperature=0, stream=True)]
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        got = await asyncio.wait_for(asyncio.gather(*(one(p) for p in PROMPTS)), 60)
    assert [t for t, _ in got] == reference["completions"]
    assert all(f == "length" for _, f in got)
    await wait_pages_free(server.url)


async def test_sse_wire_format(server):
    async with httpx.AsyncClient(base_url=server.url) as http:
        r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0,
                                                     "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream") and r.headers["x-request-id"]
    assert r.text.endswith("data: [DONE]\n\n")
    events = parse(r.text)
    assert events[-1] == "[DONE]" and all(e["id"] == r.headers["x-request-id"] for e in events[:-1])


async def test_overload_is_429_and_draining_is_503(server):
    state = server.state
    async with client(server) as oa:
        state.max_inflight = 0
        try:
            with pytest.raises(openai.RateLimitError) as e:
                await oa.completions.create(model="m", prompt="x", max_tokens=2)
            assert e.value.body["type"] == "rate_limit_error"
        finally:
            state.max_inflight = 1024
        state.draining = True
        try:
            with pytest.raises(openai.InternalServerError) as e:
                await oa.completions.create(model="m", prompt="x", max_tokens=2)
            assert e.value.status_code == 503
        finally:
            state.draining = False
        assert (await oa.completions.create(model="m", prompt="x", max_tokens=2)).usage.completion_tokens == 2

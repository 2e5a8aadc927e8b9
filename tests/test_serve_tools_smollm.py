"""Tool calling with the default model (SmolLM2-135M-Instruct) through `slipstream serve` and the
OpenAI client: each tool_choice, parallel calls, streamed = not streamed (greedy, one request at a
time), a multi-turn exchange with results, and /v1/responses. SmolLM2 writes calls as
`<tool_call>[{...}, ...]</tool_call>` (slipstream/tool_calls/formats.py)."""
import json

import pytest
from serve_util import ThreadServer

from slipstream import EngineConfig
from slipstream.serve import EngineBackend

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
from openai import AsyncOpenAI  # noqa: E402

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
ZONE = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a time zone",
                                           "parameters": ZONE}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# one earlier exchange with two calls and their results: the 135M model then calls in parallel
SHOT = [{"role": "user", "content": "Weather in Oslo and Lima?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "5 C"},
        {"role": "tool", "tool_call_id": "b", "content": "20 C"},
        {"role": "assistant", "content": "Oslo is at 5 C and Lima at 20 C."}]


@pytest.fixture(scope="module")
def server():
    with ThreadServer(EngineBackend(EngineConfig())) as s:
        yield s


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


async def streamed(oa, **args):
    content, calls, finish = "", {}, None
    async for c in await oa.chat.completions.create(**args, stream=True):
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            entry = calls.setdefault(t.index, ["", ""])
            entry[0] += t.function.name or ""
            entry[1] += t.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return content or None, [(n, json.loads(a)) for n, a in calls.values()], finish


@pytest.mark.parametrize("choice", ["required", "auto", "none", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "auto", "none", "named"])
async def test_each_tool_choice_streamed_equals_not_streamed(server, choice):
    args = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0,
                max_tokens=24 if choice in ("auto", "none") else 60)  # (a text answer runs to max_tokens)
    async with client(server) as oa:
        r = await oa.chat.completions.create(**args)
        s = await streamed(oa, **args)
    msg = r.choices[0].message
    assert s == (msg.content, calls_of(msg), r.choices[0].finish_reason)
    if choice == "required":
        assert calls_of(msg) == [("get_weather", {"city": "Paris"})] and r.choices[0].finish_reason == "tool_calls"
    elif choice == "none":
        assert msg.content and not msg.tool_calls
    elif choice != "auto":
        assert [n for n, _ in calls_of(msg)] == ["get_time"] and msg.content is None


async def test_parallel_calls_and_the_exchange_that_follows(server):
    messages = [*SHOT, {"role": "user", "content": "What is the weather in Paris and in Rome?"}]
    async with client(server) as oa:
        r = await oa.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                             max_tokens=80, temperature=0)
        one = await oa.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=80, temperature=0)
        assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
        assert calls_of(one.choices[0].message) == [("get_weather", {"city": "Paris"})]
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": t}
                     for c, t in zip(r.choices[0].message.tool_calls, ["18 C", "25 C"])]
        final = await oa.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=30,
                                                 temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content


async def test_responses_streamed_and_not(server):
    args = dict(model="m", input="What is the weather in Paris?", tools=[{"type": "function", **t["function"]}
                                                                        for t in TOOLS],
                tool_choice="required", max_output_tokens=60, temperature=0)
    async with client(server) as oa:
        r = await oa.responses.create(**args)
        events = [e async for e in await oa.responses.create(**args, stream=True)]
        text = await oa.responses.create(model="m", input="Say hello.", max_output_tokens=20, temperature=0)
        text_events = [e async for e in await oa.responses.create(model="m", input="Say hello.",
                                                                   max_output_tokens=20, temperature=0, stream=True)]
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == [
        ("function_call", "get_weather", {"city": "Paris"})]
    final = events[-1].response
    assert events[-1].type == "response.completed" and final.output[0].arguments == r.output[0].arguments
    assert "".join(e.delta for e in text_events if e.type == "response.output_text.delta") == text.output_text
    assert text.output_text and text_events[-1].response.output_text == text.output_text

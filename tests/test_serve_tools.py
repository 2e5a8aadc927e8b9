"""Tool calling and the Responses API through `slipstream serve` (tiny random model), driven by the
official OpenAI client: every tool_choice, parallel calls, streamed = not streamed, a multi-turn
exchange with tool results, /v1/responses streamed and not, 400s naming the field, and 200 forced
calls of a random-weight model whose arguments all validate against their schemas."""
import asyncio
import json

import pytest
from serve_util import ThreadServer
from tool_schemas import NOT_OBJECTS

from slipstream import EngineConfig
from slipstream.serve import EngineBackend

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
from openai import AsyncOpenAI  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                            "units": {"enum": ["c", "f"]}},
           "required": ["city", "days", "units"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 10},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                                           "safe": {"type": "boolean"}},
          "required": ["query"], "additionalProperties": False}
ORDER = {"type": "object", "$defs": {"line": {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["sku", "qty"], "additionalProperties": False}},
    "properties": {"lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 3}},
    "required": ["lines"], "additionalProperties": False}
PLOT = {"type": "object", "properties": {
    "at": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                            "y": {"type": "integer", "minimum": 0, "maximum": 99}},
           "required": ["x", "y"], "additionalProperties": False},
    "label": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "null"}]}},
    "required": ["at", "label"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "order": ORDER, "plot": PLOT, "now": None}
TOOLS = [{"type": "function", "function": {"name": n, **({"parameters": s} if s else {})}} for n, s in SCHEMAS.items()]
FLAT = [{"type": "function", "name": n, **({"parameters": s} if s else {})} for n, s in SCHEMAS.items()]
ASK = [{"role": "user", "content": "Weather?"}]


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(model="tiny-random", max_batch_size=64, max_num_batched_tokens=1024, kv_cache_tokens=65536,
                          batch_invariant=True)  # seeded answers do not depend on their neighbours
    with ThreadServer(EngineBackend(config)) as s:
        yield s


def client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def valid(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name] or {"type": "object", "additionalProperties": False})


def reassembled(chunks) -> tuple[str | None, list[tuple[str, str, str]], str]:
    """(content, [(id, name, arguments)], finish_reason) from chat chunks, as a client accumulates them."""
    content, calls, finish = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            call = calls.setdefault(t.index, ["", "", ""])
            call[0] += t.id or ""
            call[1] += (t.function.name or "") if t.function else ""
            call[2] += (t.function.arguments or "") if t.function else ""
        finish = c.choices[0].finish_reason or finish
    return content or None, [tuple(v) for v in calls.values()], finish


CHOICES = ["required", "auto", "none", {"type": "function", "function": {"name": "order"}}]


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "auto", "none", "named"])
async def test_every_tool_choice_streamed_equals_not_streamed(server, choice):
    args = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=7,
                max_tokens=100 if choice in ("auto", "none") else 300, parallel_tool_calls=False)
    async with client(server) as oa:
        r = await oa.chat.completions.create(**args)
        chunks = [c async for c in await oa.chat.completions.create(**args, stream=True)]
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
    content, streamed_calls, streamed_finish = reassembled(chunks)
    assert (content, [(n, a) for _, n, a in streamed_calls], streamed_finish) == (msg.content, calls, finish)
    assert all(i.startswith("call_") for i, _, _ in streamed_calls)
    if choice == "none":
        assert not calls and finish in ("stop", "length") and msg.content
    elif choice != "auto":  # a call, valid, and only the named function when one is named
        assert finish == "tool_calls" and len(calls) == 1 and msg.content is None
        assert choice == "required" or calls[0][0] == "order"
        valid(*calls[0])
    for name, arguments in calls:
        valid(name, arguments)


async def test_parallel_calls(server):
    async with client(server) as oa:
        async def calls(seed: int, parallel: bool):
            r = await oa.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                                 parallel_tool_calls=parallel, max_tokens=300, seed=seed)
            assert r.choices[0].finish_reason in ("tool_calls", "length")
            done = r.choices[0].finish_reason == "tool_calls"
            return [c for c in r.choices[0].message.tool_calls if done or c is not r.choices[0].message.tool_calls[-1]]
        many = await asyncio.gather(*(calls(s, True) for s in range(8)))
        single = await asyncio.gather(*(calls(s, False) for s in range(4)))
    assert max(len(c) for c in many) >= 2, [len(c) for c in many]  # the random model goes on calling at times
    assert all(len(c) == 1 for c in single)
    for c in [c for cs in many + single for c in cs]:
        valid(c.function.name, c.function.arguments)
    ids = [c.id for cs in many for c in cs]
    assert len(set(ids)) == len(ids)


async def test_multi_turn_with_tool_results(server):
    async with client(server) as oa:
        messages = [{"role": "system", "content": "Use the tools."}, *ASK]
        r = await oa.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="required",
                                             max_tokens=300, seed=1)
        calls = r.choices[0].message.tool_calls
        messages.append(r.choices[0].message.model_dump(exclude_none=True))  # as agent loops send it back
        messages += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"ok": i})}
                     for i, c in enumerate(calls)]
        r2 = await oa.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none",
                                              max_tokens=5, seed=2)
        assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
        r3 = await oa.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                              tool_choice={"type": "function", "function": {"name": "now"}},
                                              max_tokens=100, seed=3)
        assert [c.function.arguments for c in r3.choices[0].message.tool_calls] == ["{}"]
    # the prompt holds the call as the model writes it and the result as a tool response
    import httpx
    async with httpx.AsyncClient(base_url=server.url) as http:
        ids = (await http.post("/tokenize", json={"messages": messages})).json()["tokens"]
        text = (await http.post("/detokenize", json={"tokens": ids})).json()["prompt"]
    name, arguments = calls[0].function.name, calls[0].function.arguments
    assert f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>' in text
    assert '<tool_response>\n{"ok": 0}\n</tool_response>' in text


async def test_responses_streamed_and_not(server):
    args = dict(model="m", input=[{"role": "user", "content": "Weather?"}], instructions="Use the tools.", tools=FLAT,
                tool_choice="required", parallel_tool_calls=False, max_output_tokens=300, temperature=1.0,
                extra_body={"seed": 5})
    async with client(server) as oa:
        r = await oa.responses.create(**args)
        events = [e async for e in await oa.responses.create(**args, stream=True)]
        text = await oa.responses.create(model="m", input="Hello", max_output_tokens=6, temperature=0)
        text_events = [e async for e in await oa.responses.create(model="m", input="Hello", max_output_tokens=6,
                                                                   temperature=0, stream=True)]
        # a tool's output goes back as an input item; the answer runs on it
        follow = await oa.responses.create(model="m", tools=FLAT, max_output_tokens=4, temperature=0, input=[
            *args["input"], *[o.model_dump(exclude_none=True) for o in r.output],
            {"type": "function_call_output", "call_id": r.output[0].call_id, "output": "sunny"}])
    assert r.status == "completed" and [o.type for o in r.output] == ["function_call"]
    valid(r.output[0].name, r.output[0].arguments)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [(o.name, o.arguments) for o in final.output] == [(o.name, o.arguments) for o in r.output]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == r.output[0].arguments
    assert final.usage.output_tokens == r.usage.output_tokens and final.usage.input_tokens == r.usage.input_tokens
    assert text.status == "incomplete" and text.incomplete_details.reason == "max_output_tokens"
    assert [e.type for e in text_events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * sum(e.type == "response.output_text.delta" for e in text_events),
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.incomplete"]
    assert text_events[-1].response.output_text == text.output_text
    assert follow.output[0].type == "message" and follow.usage.input_tokens > r.usage.input_tokens


BAD_CHAT = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS * 26}, "tools"),
    ({"tools": TOOLS, "n": 2}, "n"),
    ({"tools": TOOLS, "regex": "a+"}, "regex"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [*ASK, {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id"),
    ({"tools": TOOLS, "messages": [*ASK, {"role": "tool", "tool_call_id": None, "content": "18 C"}]},
     "messages[1].tool_call_id"),
    ({"tools": TOOLS, "messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_wether", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": "c", "content": "1"}]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "no such name", "arguments": "{}"}}]}]}, "messages[1].tool_calls[0].function.name"),
]
BAD_RESPONSES = [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    ({"tools": FLAT, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"type": "mystery"}]}, "input[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"tools": FLAT, "input": [{"type": "function_call", "call_id": "c", "name": "get_wether", "arguments": "{}"}]},
     "input"),
]


async def test_bad_requests_are_400s_naming_the_field(server):
    import httpx
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for body, param in BAD_CHAT:
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        for body, param in BAD_RESPONSES:
            r = await http.post("/v1/responses", json={"model": "m", "input": "hi", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


async def test_200_forced_calls_of_a_random_model_are_valid(server):
    """Sampled at temperature 1 from random weights: only the grammar makes these calls valid. Each
    request has one of the tools (a short prompt: the test's time is attention over it), forced by
    `required` or by name."""
    names = list(SCHEMAS)

    async def one(oa, i: int):
        tool = TOOLS[i % 5]
        choice = {"type": "function", "function": {"name": names[i % 5]}} if i % 2 else "required"
        r = await oa.chat.completions.create(model="m", messages=ASK, tools=[tool], tool_choice=choice,
                                             parallel_tool_calls=False, max_tokens=400, temperature=1.0, seed=1000 + i)
        return r.choices[0]

    async with client(server) as oa:
        first = await asyncio.gather(*(one(oa, i) for i in range(5)))  # then the others' prompts are cached
        answers = [*first, *await asyncio.gather(*(one(oa, i) for i in range(5, 200)))]
    assert [a.finish_reason for a in answers] == ["tool_calls"] * 200
    for i, a in enumerate(answers):
        (call,) = a.message.tool_calls
        assert call.function.name == names[i % 5]
        valid(call.function.name, call.function.arguments)


async def test_parameters_that_are_not_an_object_are_400s(server):
    """Every schema whose values are not all objects, on both endpoints and wherever the tool sits."""
    import httpx
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for schema in NOT_OBJECTS:
            tools = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": schema}}]
            r = await http.post("/v1/chat/completions", json={"model": "m", "messages": ASK, "tools": tools,
                                                               "max_tokens": 4})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools[1].function.parameters", (schema, r.text)
            r = await http.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 4, "tools": [
                {"type": "function", "name": "f", "parameters": schema}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].parameters", (schema, r.text)


_X = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
      "additionalProperties": False}
TIGHT_OBJECTS = [{"$ref": "#/$defs/x", "$defs": {"x": _X}}, {"allOf": [_X, {"required": ["x"]}]},
                 {"anyOf": [_X, {"$ref": "#/$defs/x"}], "$defs": {"x": _X}}, {"oneOf": [_X]}, {"const": {"x": 1}},
                 {"enum": [{"x": 1}, {"y": 2}]}, {}]  # (OBJECTS' open ones: the random model writes on and on)


async def test_object_schemas_give_object_arguments_streamed_as_not(server):
    """Schemas that reach objects through $ref, allOf, anyOf, oneOf, const, enum (and `{}`): every
    forced call's arguments are a JSON object, and the stream puts together the same answer."""
    async def one(oa, i: int, schema: dict):
        args = dict(model="m", messages=ASK, tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                    tool_choice="required", parallel_tool_calls=False, max_tokens=100, temperature=1.0,
                    seed=i)
        r = await oa.chat.completions.create(**args)
        chunks = [c async for c in await oa.chat.completions.create(**args, stream=True)]
        msg = r.choices[0].message
        content, calls, finish = reassembled(chunks)
        assert (content, [(n, a) for _, n, a in calls], finish) == (
            msg.content, [(c.function.name, c.function.arguments) for c in msg.tool_calls], r.choices[0].finish_reason)
        if r.choices[0].finish_reason == "tool_calls":
            assert all(isinstance(json.loads(c.function.arguments), dict) for c in msg.tool_calls), schema
            jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), schema)
        return r.choices[0].finish_reason

    async with client(server) as oa:
        finishes = await asyncio.gather(*(one(oa, i, s) for i, s in enumerate(TIGHT_OBJECTS)))
    assert finishes == ["tool_calls"] * len(TIGHT_OBJECTS)


async def test_tokenize_renders_the_tools_as_chat_completions_do(server):
    import httpx
    history = [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "search", "arguments": '{"query": "x"}'}}]}, {"role": "tool", "tool_call_id": "c", "content": "1"}]
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        for messages, tools in [(ASK, TOOLS), (ASK, TOOLS[:1]), (history, TOOLS), (history, None)]:
            body = {"messages": messages, **({"tools": tools} if tools else {})}
            count = (await http.post("/tokenize", json=body)).json()["count"]
            r = await http.post("/v1/chat/completions", json={"model": "m", **body, "max_tokens": 1})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == count, (tools, r.text)
        r = await http.post("/tokenize", json={"prompt": "hi", "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        r = await http.post("/tokenize", json={"messages": ASK, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"enum": [1]}}}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.parameters"


PARIS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"], "additionalProperties": False}}}]
WHOLE = '{"city": "Paris"}'  # the only call the grammar allows: <tool_call>\n{"name": ..., "arguments": WHOLE}\n</tool_call>
CUTS = [  # (stop, max_tokens, the calls' arguments, finish_reason)
    (["}"], 200, ['{"city": "Paris"'], "stop"),  # inside the arguments
    (['"Par'], 200, ['{"city": '], "stop"),
    (["weat"], 200, [], "stop"),  # inside the name: no call yet
    (['"arguments"'], 200, [""], "stop"),  # between the name and the arguments
    (["}\n</tool"], 200, [WHOLE], "tool_calls"),  # across the closing tag: the arguments are whole
    (["</tool_call>"], 200, [WHOLE], "tool_calls"),
    (["<tool_call>"], 200, [], "stop"),
    (None, 30, [], "length"),  # max_tokens (a byte a token: the call's frame is 49)
    (None, 55, ['{"city'], "length"),
    (None, 65, ['{"city": "Paris"'], "length"),
    (None, 200, [WHOLE], "tool_calls"),
]


@pytest.mark.parametrize("stop,max_tokens,arguments,finish", CUTS, ids=[f"{s}-{m}" for s, m, _, _ in CUTS])
async def test_a_cut_call_is_not_reported_as_complete(server, stop, max_tokens, arguments, finish):
    """A call that a stop string or max_tokens cut keeps what it had (streams sent it already) but
    its answer's finish_reason is "stop" / "length": "tool_calls" only when every call is whole."""
    args = dict(model="m", messages=ASK, tools=PARIS, tool_choice="required", parallel_tool_calls=False,
                max_tokens=max_tokens, temperature=0, **({"stop": stop} if stop else {}))
    async with client(server) as oa:
        r = await oa.chat.completions.create(**args)
        chunks = [c async for c in await oa.chat.completions.create(**args, stream=True)]
    msg = r.choices[0].message
    got = ([c.function.arguments for c in msg.tool_calls or []], r.choices[0].finish_reason)
    assert got == (arguments, finish)
    content, calls, streamed_finish = reassembled(chunks)
    assert (content, [a for _, _, a in calls], streamed_finish) == (msg.content, arguments, finish)


async def test_responses_mark_a_cut_call_incomplete(server):
    args = dict(model="m", input="Weather?", tools=[{"type": "function", **PARIS[0]["function"]}],
                tool_choice="required", parallel_tool_calls=False, max_output_tokens=65, temperature=0)
    async with client(server) as oa:
        r = await oa.responses.create(**args)
        events = [e async for e in await oa.responses.create(**args, stream=True)]
    assert [(o.arguments, o.status) for o in r.output] == [('{"city": "Paris"', "incomplete")]
    final = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert [(o.arguments, o.status) for o in final.output] == [('{"city": "Paris"', "incomplete")]

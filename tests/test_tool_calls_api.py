"""Tool calling in process: Engine.chat / chat_stream / LLM.chat with tools return parsed calls; history
with calls and results renders; bad tools raise InvalidRequestError naming the field at the call."""
import json

import pytest
from worker_util import engine_config

from slipstream import LLM, Engine, InvalidRequestError, SamplingParams

ARGS = {"type": "object", "properties": {"word": {"enum": ["alpha", "beta"]}, "n": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 9}},
        "required": ["word", "n"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "say", "parameters": ARGS}},
         {"type": "function", "function": {"name": "stop"}}]
ASK = [{"role": "user", "content": "go"}]
SEEDED = SamplingParams(max_tokens=120, temperature=1.0, seed=11)


async def test_engine_chat_with_tools():
    async with Engine(engine_config()) as engine:
        out = await engine.chat(ASK, SEEDED, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        deltas = [d async for d in engine.chat_stream(ASK, SEEDED, tools=TOOLS, tool_choice="required",
                                                      parallel_tool_calls=False)]
        named = await engine.chat(ASK, SEEDED, tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "stop"}})
        none = await engine.chat(ASK, SamplingParams(max_tokens=8, temperature=0), tools=TOOLS, tool_choice="none")
        plain = await engine.chat(ASK, SamplingParams(max_tokens=8, temperature=0))
        # a history with calls and results renders in the tool format whether or not tools are given
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "say", "arguments": {"word": "beta", "n": 2}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]
        prompt = await engine.chat_prompt(history)
        for bad, param in [(dict(tools=[{"type": "function", "function": {"name": "say", "parameters": []}}]),
                            "tools[0].function.parameters"),
                           (dict(tools=TOOLS, tool_choice="whichever"), "tool_choice"),
                           (dict(tools=TOOLS, parallel_tool_calls="yes"), "parallel_tool_calls")]:
            with pytest.raises(InvalidRequestError) as e:
                await engine.chat(ASK, **bad)
            assert e.value.param == param
        with pytest.raises(InvalidRequestError) as e:  # a history call without its arguments
            await engine.chat([*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "say"}}]}],
                              tools=TOOLS)
        assert e.value.param == "messages[1].tool_calls[0].function.arguments"
        with pytest.raises(InvalidRequestError) as e:
            await engine.chat(ASK, SamplingParams(n=2), tools=TOOLS)
        assert e.value.param == "n"
        with pytest.raises(InvalidRequestError) as e:
            [d async for d in engine.chat_stream(ASK, SamplingParams(regex="a"), tools=TOOLS)]
        assert e.value.param == "regex"
    (call,) = out.tool_calls
    assert out.finish_reason == "stop" and out.content == "" and call.name in ("say", "stop")
    assert call.id.startswith("call_") and isinstance(call.parsed_arguments(), dict)
    assert "".join(d.text for d in deltas) == out.text and all(d.content == "" for d in deltas)
    pieces = [p for d in deltas for p in d.tool_calls]
    assert [(p.name, "".join(q.arguments for q in pieces if q.index == p.index)) for p in pieces if p.id] == \
        [(call.name, call.arguments)]
    assert [(c.name, c.arguments) for c in named.tool_calls] == [("stop", "{}")]
    assert (none.content, none.tool_calls) == (none.text, [])  # none: a plain answer (the tools in its prompt)
    assert len(none.prompt_token_ids) > len(plain.prompt_token_ids) + 100
    assert plain.content is None and plain.tool_calls is None
    assert '<tool_call>\n{"name": "say", "arguments": {"word": "beta", "n": 2}}\n</tool_call>' in prompt
    assert "<tool_response>\ndone\n</tool_response>" in prompt


def test_llm_chat_with_tools():
    with LLM(engine_config()) as llm:
        outs = llm.chat([ASK, ASK], [SEEDED, SamplingParams(max_tokens=120, temperature=1.0, seed=12)], tools=TOOLS,
                        tool_choice="required", parallel_tool_calls=False)
        with pytest.raises(InvalidRequestError) as e:
            llm.chat(ASK, tools=TOOLS * 2)
        assert e.value.param == "tools[2].function.name"
    for out in outs:
        (call,) = out.tool_calls
        if call.name == "say":
            args = json.loads(call.arguments)
            assert args["word"] in ("alpha", "beta") and 1 <= args["n"] <= 9

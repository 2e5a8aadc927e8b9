"""Tool calling over HTTP: a request's tools made into a ToolPlan, and the calls in OpenAI's shapes.

The plan is the Engine's (slipstream/tool_calls/plan.py): the server renders the prompt with the
tools, sends token ids with the tool-call grammar in the params (so an in-process engine and
workers run the same request) and parses the output text here, streamed or not, with the same
parser. A stream's chunks carry the answer's text as `content` and each call as it is written:
its index, id, type and name first (arguments ""), then fragments of its arguments; the last
chunk's finish_reason is "tool_calls" when the answer made calls and ended on its own.
"""
from __future__ import annotations

import json
from typing import Any

import msgspec

from slipstream import validate as check
from slipstream.errors import InvalidRequestError
from slipstream.outputs import CompletionOutput, ToolCall, ToolCallDelta
from slipstream.params import SamplingParams
from slipstream.serve.api_errors import invalid
from slipstream.tool_calls.parser import ToolCallParser
from slipstream.tool_calls.plan import ToolPlan, make_plan, tool_prompt


def plan_of(tokenizer: Any, tools: Any, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The request's checked plan (400 naming the field), or None without tools and tool_choice."""
    try:
        return make_plan(tokenizer, None if tools is None else msgspec.to_builtins(tools),
                         None if tool_choice is None else msgspec.to_builtins(tool_choice), parallel_tool_calls)
    except InvalidRequestError as e:
        raise invalid(str(e), e.param) from None


def constrain(plan: ToolPlan, params: SamplingParams, grammar_param: str | None
              ) -> tuple[ToolPlan, SamplingParams, str | None]:
    """The params with the tool-call grammar; a grammar that fails to compile is blamed on `tools`."""
    try:
        plan, params = plan.params(params)
    except InvalidRequestError as e:
        param = "response_format" if e.param == "json_schema" else e.param
        raise invalid(str(e), param) from None
    return plan, params, ("tools" if plan.choice != "none" else grammar_param)


def uses_tools(messages: list, plan: ToolPlan | None) -> bool:
    return plan is not None or any(m.tool_calls or m.role == "tool" for m in messages)


def prompt_text(tokenizer: Any, messages: list, plan: ToolPlan | None, add_generation_prompt: bool = True) -> str:
    """The chat template over typed messages with their calls and results, and the plan's tools."""
    dicts = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.template_content() if m.content is not None else None}
        if m.tool_calls is not None:
            d["tool_calls"] = msgspec.to_builtins(m.tool_calls)
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            d["name"] = m.name
        dicts.append(d)
    try:
        return tool_prompt(tokenizer, check.messages(dicts), plan, add_generation_prompt)
    except InvalidRequestError as e:
        raise invalid(str(e), e.param or "messages") from None


def call_json(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def delta_json(d: ToolCallDelta) -> dict:
    """A call's piece in a chunk: the start carries id, type and name; later pieces only arguments."""
    if d.id is None:
        return {"index": d.index, "function": {"arguments": d.arguments}}
    return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}}


def complete(arguments: str) -> bool:
    """Whether a call's arguments are whole JSON: the grammar writes nothing else, so a call whose
    arguments are not was cut (a stop string, a stop token, max_tokens)."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def finish_reason(reason: str, arguments: list[str]) -> str:
    """"tool_calls" when the answer made calls, ended on its own and every call is whole; a call cut
    by a stop string or stop token leaves "stop" (clients read "tool_calls" as "the calls are complete")."""
    done = bool(arguments) and reason == "stop" and all(complete(a) for a in arguments)
    return "tool_calls" if done else reason


def message(out: CompletionOutput) -> tuple[dict, str]:
    """(the chat message, the finish reason) of an output with tools."""
    calls = out.tool_calls or []
    msg: dict[str, Any] = {"role": "assistant", "content": out.content or None}
    if calls:
        msg["tool_calls"] = [call_json(c) for c in calls]
    return msg, finish_reason(out.finish_reason, [c.arguments for c in calls])


class ToolChunks:
    """A stream's text deltas as chat chunk deltas (the same parser as a non-streamed answer)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser

    def delta(self, text: str, last: bool) -> dict | None:
        content, calls = self.parser.push(text)
        if last:
            content += self.parser.finish()[0]
        body: dict[str, Any] = {}
        if content:
            body["content"] = content
        if calls:
            body["tool_calls"] = [delta_json(c) for c in calls]
        return body or None

    def finish(self, reason: str) -> str:
        return finish_reason(reason, [a for _, _, a in self.parser.calls])

"""One request's tools made into what the engine runs and what the caller gets back.

`ToolPlan` joins a checked `ToolRequest` (spec.py) and the model's `ToolFormat` (formats.py): the
prompt with the tools shown to the model, the SamplingParams with the tool-call grammar, and the
parser that splits the output into the answer's text and its calls. Engine.chat, the worker and the
HTTP server (which tokenizes itself and may send the request to a worker) all go through it.

How the choice constrains the output:
- `none`: the tools are in the prompt (as vLLM does), but no grammar and nothing parsed: a plain answer.
- `auto`: the tool-call grammar in `auto` mode: free text, calls valid once started (a lazy grammar).
- `required` / a named function: the output is calls only (a named function: exactly one call of it).
A `json_schema` in the params (OpenAI's response_format) constrains the text answer of `auto`: the
output is then that JSON document or calls. Other constraints (regex, choice, grammar) and n > 1
are refused alongside tools.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec

from slipstream.errors import InvalidRequestError
from slipstream.grammar.base import GrammarSpec
from slipstream.grammar.tool_calls import ToolGrammar, tool_grammar_value
from slipstream.outputs import CompletionOutput, StreamDelta
from slipstream.params import SamplingParams
from slipstream.tool_calls.formats import ToolFormat, render_prompt, tool_format
from slipstream.tool_calls.parser import ToolCallParser
from slipstream.tool_calls.spec import ToolRequest, check_history, tool_request


@dataclass(frozen=True)
class ToolPlan:
    request: ToolRequest
    format: ToolFormat
    json_answer: bool = False  # set by `params`: the text answer is a JSON document (calls only at the start)

    @property
    def choice(self) -> str:
        return self.request.choice

    def prompt(self, tokenizer: Any, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_prompt(self.format, tokenizer, messages, self.request.tools, add_generation_prompt)

    def params(self, params: SamplingParams | None) -> tuple["ToolPlan", SamplingParams]:
        """(this plan as the params make it, the params with the tool-call grammar)."""
        params = params or SamplingParams()
        if params.n > 1:
            raise InvalidRequestError("n > 1 is not available with tools; send n requests", param="n")
        other = [f for f in ("regex", "choice", "grammar") if getattr(params, f) is not None]
        if other:
            raise InvalidRequestError(f"{other[0]} cannot be combined with tools (only a json_schema response "
                                      "format can)", param=other[0])
        if self.choice == "none":
            return self, params
        spec = params.grammar_spec() if params.json_schema is not None else None
        content = spec.value if spec is not None else None
        if content is not None and self.format.syntax.at_start and self.choice == "auto":
            raise InvalidRequestError(f"a json_schema response format with tool_choice 'auto' is not available for "
                                      f"this model's tool format ({self.format.name}: calls and JSON both open the "
                                      "answer)", param="json_schema")
        required = self.choice == "required"
        grammar = ToolGrammar(self.format.syntax, [(t.name, t.schema_text()) for t in self.request.callable],
                              "required" if required else "auto", self.request.parallel and self.format.parallel,
                              None if required else content)
        plan = dataclasses.replace(self, json_answer=content is not None and not required)
        return plan, msgspec.structs.replace(params, json_schema=None,
                                             grammar=GrammarSpec("tool_calls", tool_grammar_value(grammar)))

    def parser(self) -> ToolCallParser | None:
        if self.choice == "none":
            return None
        return ToolCallParser(self.format.syntax, self.choice == "required", at_start=self.json_answer)

    def output(self, out: CompletionOutput) -> CompletionOutput:
        """`out` with its text split into `content` and `tool_calls`."""
        parser = self.parser()
        if parser is None:
            return dataclasses.replace(out, content=out.text, tool_calls=[])
        content, calls = parser.parse(out.text)
        return dataclasses.replace(out, content=content, tool_calls=calls)


def make_plan(tokenizer: Any, tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = True
              ) -> ToolPlan | None:
    """The plan of a request's tools for this tokenizer's model, or None when it has none."""
    request = tool_request(tools, tool_choice, parallel_tool_calls)
    return None if request is None else ToolPlan(request, tool_format(tokenizer))


def tool_prompt(tokenizer: Any, messages: list[dict], plan: ToolPlan | None, add_generation_prompt: bool = True) -> str:
    """The prompt of checked messages with the plan's tools, or (none) of a history holding calls."""
    check_history(messages, plan.request if plan is not None else None)
    if plan is not None:
        return plan.prompt(tokenizer, messages, add_generation_prompt)
    return render_prompt(tool_format(tokenizer), tokenizer, messages, (), add_generation_prompt)


def has_tool_messages(messages: Any) -> bool:
    """Whether a conversation holds calls or results (it is then rendered in the tool format)."""
    return isinstance(messages, (list, tuple)) and any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages)


def with_calls(d: StreamDelta, parser: ToolCallParser | None) -> StreamDelta:
    """A chat stream's delta with its `content` and `tool_calls` pieces (the request's parser state)."""
    if parser is None:
        return dataclasses.replace(d, content=d.text, tool_calls=[])
    content, calls = parser.push(d.text)
    if d.finish_reason is not None:
        content += parser.finish()[0]
    return dataclasses.replace(d, content=content, tool_calls=calls)


def tool_dicts(tools: Any) -> Any:
    """Tools as plain data for the wire (Tool objects become the flat OpenAI shape)."""
    if not isinstance(tools, (list, tuple)):
        return tools
    return [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
            if hasattr(t, "schema_text") else t for t in tools]

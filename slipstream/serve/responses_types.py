"""POST /v1/responses request bodies (msgspec), and their translation into a chat completion request.

The Responses API is served statelessly: `input` (text, or items: messages, `function_call`s an
earlier answer made and the `function_call_output`s answering them), `instructions` (a system
message before the input), function `tools`, `tool_choice`, `parallel_tool_calls`, `text.format`
(text, json_object, json_schema), `max_output_tokens`, `temperature`, `top_p`, `stream`. It is
translated into the chat request it means (`to_chat`) and runs as one; `previous_response_id` is
refused (the server keeps no responses), `store` is accepted and nothing is stored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from slipstream.serve.api_errors import from_decode_error, invalid
from slipstream.serve.openai_types import (
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    HistoryToolCall,
    JsonSchemaFormat,
    PositiveInt,
    ResponseFormat,
    Seed,
    Temperature,
    TopP,
)
from slipstream.tool_calls.spec import MAX_TOOLS


class TextPart(msgspec.Struct, tag_field="type", tag="input_text"):
    text: str


class OutputTextPart(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []


class MessageItem(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart | OutputTextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, tag_field="type", tag="function_call_output", kw_only=True):
    call_id: str
    output: str | list[TextPart | OutputTextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(msgspec.Struct, kw_only=True):
    type: Literal["function"]  # (no built-in tools: web_search, file_search, ... are refused naming tools[i].type)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(msgspec.Struct, kw_only=True):
    type: Literal["function"]
    name: str


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """Unknown fields are ignored, as OpenAI's server does (reasoning, include, metadata, ...)."""

    model: str | None = None
    input: Annotated[str, Meta(min_length=1)] | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    seed: Seed | None = None  # slipstream extra (as on the chat API)
    speculative: bool = True  # slipstream extra, as on the chat API: False keeps drafts off its steps
    user: str | None = None


def input_items(req: ResponsesRequest) -> list[InputItem]:
    """`input`'s items, typed; an item without `type` but with a `role` is a message (EasyInputMessage)."""
    if isinstance(req.input, str):
        return [MessageItem(role="user", content=req.input)]
    out = []
    for i, item in enumerate(req.input):
        if "type" not in item and "role" in item:
            item = {**item, "type": "message"}
        try:
            out.append(msgspec.convert(item, InputItem))
        except msgspec.ValidationError as e:
            err = from_decode_error(e)
            err.param = f"input[{i}]" + (f".{err.param}" if err.param else "")
            err.message = f"input[{i}]: {err.message}"
            raise err from None
    return out


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request a Responses request means (its tools travel apart: `tools_of`)."""
    if req.previous_response_id is not None:
        raise invalid("previous_response_id: this server keeps no responses (it is stateless); send the whole "
                      "conversation in input", "previous_response_id")
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    for item in input_items(req):
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = HistoryToolCall(id=item.call_id, function=CalledFunction(item.name, item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # one answer's text and calls: one message
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            messages.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
    if not messages:
        raise invalid("input holds no message", "input")
    fmt = req.text.format if req.text is not None else None
    response_format = None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema is None:
            raise invalid("text.format: a json_schema format needs its schema", "text.format.schema")
        response_format = ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(fmt.name, fmt.schema,
                                                                                          fmt.strict))
    elif fmt is not None and fmt.type == "json_object":
        response_format = ResponseFormat(type="json_object")
    return ChatCompletionRequest(messages=messages, max_completion_tokens=req.max_output_tokens,
                                 temperature=req.temperature, top_p=req.top_p, stream=req.stream, seed=req.seed,
                                 response_format=response_format, user=req.user, speculative=req.speculative)


def tools_of(req: ResponsesRequest) -> tuple[Any, Any, bool | None]:
    """(tools, tool_choice, parallel_tool_calls) as plain data: the flat shape, named `tools[i].name`."""
    tools = None if req.tools is None else msgspec.to_builtins(req.tools)
    choice = None if req.tool_choice is None else msgspec.to_builtins(req.tool_choice)
    return tools, choice, req.parallel_tool_calls


def blame(param: str | None) -> str | None:
    """A chat request's field, as the Responses request named it."""
    if param is None:
        return None
    if param.startswith("response_format"):
        return "text.format"
    if param.startswith("messages"):
        return "input"
    return {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}.get(param, param)

"""POST /v1/responses: OpenAI's Responses API over the chat path (request: serve/responses_types.py).

The request runs as the chat request it means (generation.generate); the answer is a `response`
object whose `output` holds a `message` item with the answer's text (`output_text`) and one
`function_call` item per call. Streamed, the events follow OpenAI's documented order, each an SSE
`event:` line and its `data:` (no `[DONE]`):

    response.created, response.in_progress
    per item: response.output_item.added
        message: response.content_part.added, response.output_text.delta ..., response.output_text.done,
                 response.content_part.done
        function_call: response.function_call_arguments.delta ..., response.function_call_arguments.done
      response.output_item.done
    response.completed (or response.incomplete: max_output_tokens reached) with the whole response

A failure after the 200 is an `error` event. Every event has a `sequence_number` from 0.
"""
from __future__ import annotations

import secrets
import time
from typing import Any, cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from slipstream.outputs import CompletionOutput, ToolCallDelta, Usage
from slipstream.serve.api_errors import ApiError
from slipstream.serve.body import read_body
from slipstream.serve.chat_tools import complete
from slipstream.serve.generation import decode_json, generate
from slipstream.serve.responses_types import ResponsesRequest, blame, to_chat, tools_of
from slipstream.serve.state import ServerState, new_request_id
from slipstream.tool_calls.parser import ToolCallParser

_DECODER = msgspec.json.Decoder(ResponsesRequest)
_encode = msgspec.json.Encoder().encode


async def handle(state: ServerState, request: Request) -> Response:
    t0 = time.perf_counter()
    rid = new_request_id("resp", request.headers.get("x-request-id"))
    req = decode_json(_DECODER.decode, await read_body(request, state.max_body_bytes))
    try:
        return await generate(state, request, to_chat(req), rid, t0, ResponsesStyle(req), tools_of(req))
    except ApiError as e:  # named as the Responses request names its fields
        e.param = blame(e.param)
        raise


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def _message(text: str, status: str, msg_id: str) -> dict:
    return {"id": msg_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def _call_status(arguments: str, status: str) -> str:
    """A call a stop string or max_output_tokens cut (its arguments not whole JSON) is incomplete."""
    return status if complete(arguments) else "incomplete"


class ResponsesStyle:
    endpoint = "responses"
    logprobs = False

    def __init__(self, req: ResponsesRequest) -> None:
        self.req = req

    def response(self, rid: str, created: int, model: str, output: list, finish: str | None, usage: dict | None
                 ) -> dict:
        """The `response` object (`finish` None: still in progress)."""
        req = self.req
        status = "in_progress" if finish is None else ("incomplete" if finish == "length" else "completed")
        fmt = msgspec.to_builtins(req.text.format) if req.text and req.text.format else {"type": "text"}
        return {"id": rid, "object": "response", "created_at": created, "status": status,
                "completed_at": int(time.time()) if finish is not None else None, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
                "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": None, "store": False, "temperature": req.temperature,
                "text": {"format": fmt}, "tool_choice": msgspec.to_builtins(req.tool_choice or "auto"),
                "tools": msgspec.to_builtins(req.tools or []), "top_p": req.top_p, "truncation": "disabled",
                "usage": usage, "user": req.user, "metadata": {}}

    def body(self, tok: Any, rid: str, created: int, model: str, outs: list[CompletionOutput]) -> dict:
        out = outs[0]
        status = "incomplete" if out.finish_reason == "length" else "completed"
        text = out.text if out.tool_calls is None else out.content or ""
        calls = out.tool_calls or []
        output = [_message(text, "completed" if calls else status, _id("msg"))] if text or not calls else []
        output += [_call(_id("fc"), c.id, c.name, c.arguments, _call_status(c.arguments, status)
                         if i == len(calls) - 1 else "completed") for i, c in enumerate(calls)]
        u = cast(Usage, out.usage)  # (a finished output has its usage)
        return self.response(rid, created, model, output, out.finish_reason,
                             _usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens))

    def events(self, rid: str, created: int, model: str, prompt_tokens: int, include_usage: bool,
               parser: ToolCallParser | None) -> "ResponseEvents":
        return ResponseEvents(self, rid, created, model, prompt_tokens, parser)


class ResponseEvents:
    """The SSE events of one streamed response (what generation._stream_body sends, in order)."""

    def __init__(self, style: ResponsesStyle, rid: str, created: int, model: str, prompt_tokens: int,
                 parser: ToolCallParser | None) -> None:
        self.style, self.head, self.prompt_tokens, self.parser = style, (rid, created, model), prompt_tokens, parser
        self.seq = 0
        self.output: list[dict] = []  # finished items
        self.open: Any = None  # the item being written (a dict; None between items)
        self.finish: str | None = None

    def _event(self, kind: str, **fields) -> bytes:
        data = _encode({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def _response(self, finish: str | None, usage: dict | None = None) -> dict:
        return self.style.response(*self.head, list(self.output), finish, usage)

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self._response(None)),
                self._event("response.in_progress", response=self._response(None))]

    def delta(self, delta) -> list[bytes]:
        out: list[bytes] = []
        if self.parser is None:
            content, calls = delta.text, list[ToolCallDelta]()
        else:
            content, calls = self.parser.push(delta.text)
            if delta.finish_reason is not None:
                content += self.parser.finish()[0]
        if content:
            if self.open is None:
                out += self._open(_message("", "in_progress", _id("msg")))
            out.append(self._event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output),
                                   content_index=0, delta=content, logprobs=[]))
            self.open["content"][0]["text"] += content
        for c in calls:
            if c.id is not None:  # a new call
                out += self._close("completed")
                out += self._open(_call(_id("fc"), c.id, cast(str, c.name), "", "in_progress"))  # (named with its id)
            if c.arguments:
                out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                       output_index=len(self.output), delta=c.arguments))
                self.open["arguments"] += c.arguments
        if delta.finish_reason is not None:
            self.finish = delta.finish_reason
        return out

    def _open(self, item: dict) -> list[bytes]:
        self.open = item
        events = [self._event("response.output_item.added", output_index=len(self.output), item=item)]
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def _close(self, status: str) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        at, events = len(self.output), []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                   text=part["text"], logprobs=[]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=at,
                                   content_index=0, part=part)]
        else:
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                      name=item["name"], arguments=item["arguments"]))
        item["status"] = status
        self.output.append(item)
        return events + [self._event("response.output_item.done", output_index=at, item=item)]

    def end(self, n_out: int, cached: int) -> list[bytes]:
        status = "incomplete" if self.finish == "length" else "completed"
        events = []
        if not self.output and self.open is None:  # an empty answer is still a message, as unstreamed
            events += self._open(_message("", "in_progress", _id("msg")))
        if self.open is not None and self.open["type"] == "function_call":
            events += self._close(_call_status(self.open["arguments"], status))
        events += self._close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        usage = _usage(self.prompt_tokens, n_out, cached)
        return events + [self._event(kind, response=self._response(self.finish or "stop", usage))]

    def error(self, err: ApiError) -> list[bytes]:
        e = err.body()["error"]
        return [self._event("error", code=e["code"], message=e["message"], param=e["param"])]

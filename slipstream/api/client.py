"""slipstream.Client: the EngineAPI (slipstream/api/interface.py) served by a `slipstream worker`.

This file holds the request methods: a prompt checked and sent as a Generate, its waiter, and the
calls (abort, stats, health, chat_prompt, metrics_text). The connection they go through (socket,
handshake, reconnection, routing replies, liveness; start and close) is the base class,
`WorkerConnection` in slipstream/api/client_connection.py, which says what a call may count on.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
import time
from typing import Any, Sequence

import msgspec

from slipstream import validate as check
from slipstream.api.client_connection import WorkerConnection, _Pending
from slipstream.api.client_stream import ClientStream
from slipstream.api.interface import DeltaStream, Messages, Prompt, ToolChoice, Tools
from slipstream.api.skills import SkillMethods
from slipstream.api.fanout import fan_out, wants_fan_out
from slipstream.api.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ChatPromptRequest,
    Generate,
    HealthReply,
    MetricsRequest,
    StatsRequest,
)
from slipstream.errors import InvalidRequestError
from slipstream.images import ImageLike, image_list, images_to_bytes
from slipstream.outputs import CompletionOutput
from slipstream.params import SamplingParams
from slipstream.tool_calls.plan import tool_dicts
from slipstream.tool_calls.spec import tool_request


class Client(WorkerConnection, SkillMethods):
    def __init__(self, address: str, timeout: float = 30.0, connect_timeout: float | None = None):
        super().__init__(address, timeout, connect_timeout)
        self._ids = itertools.count()
        self._id_prefix = f"req-{secrets.token_hex(4)}-"  # auto ids never look like a user's "req-1"

    # --- requests -------------------------------------------------------------------------------

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, *, images: Sequence[ImageLike] = ()
                       ) -> CompletionOutput | list[CompletionOutput]:
        """One CompletionOutput; with params.n > 1, a list of n (fanned out here: api/fanout.py).
        `images` travel encoded (a PIL image as PNG); the worker decodes and validates them."""
        wire = await self._wire_images(images)
        if wants_fan_out(params):
            return await fan_out(lambda p, rid: self._complete(rid, p, prompt=prompt, images=wire), params,
                                 request_id)
        return await self._complete(request_id, params, prompt=prompt, images=wire)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None, *, images: Sequence[ImageLike] = ()) -> DeltaStream:
        return ClientStream(self, request_id, params, {"prompt": prompt, "images": images})

    async def chat(self, messages: Messages, params: SamplingParams | None = None,
                   request_id: str | None = None, *, images: Sequence[ImageLike] = (), tools: Tools = None,
                   tool_choice: ToolChoice = None, parallel_tool_calls: bool = True
                   ) -> CompletionOutput | list[CompletionOutput]:
        """The worker applies its model's chat template (Engine.chat), tools included."""
        tools_args = (tools, tool_choice, parallel_tool_calls)
        _tools_kw(*tools_args, params)  # refused before the images are encoded
        wire = await self._wire_images(images)
        if wants_fan_out(params):
            return await fan_out(lambda p, rid: self._complete(rid, p, messages=messages, images=wire), params,
                                 request_id)
        return await self._complete(request_id, params, messages=messages, images=wire, tools=tools_args)

    def chat_stream(self, messages: Messages, params: SamplingParams | None = None,
                    request_id: str | None = None, *, images: Sequence[ImageLike] = (), tools: Tools = None,
                    tool_choice: ToolChoice = None, parallel_tool_calls: bool = True) -> DeltaStream:
        return ClientStream(self, request_id, params, {"messages": messages, "images": images,
                                                       "tools": (tools, tool_choice, parallel_tool_calls)})

    async def chat_prompt(self, messages: Messages) -> str:
        """Rendered by the worker, with its model's chat template."""
        messages = check.messages(messages)
        reply = await self._call(ChatPromptRequest(v=PROTOCOL_VERSION, seq=next(self._seq), messages=messages))
        return reply.prompt

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its waiter gets finish_reason "abort". False if unknown or finished."""
        reply = await self._call(Abort(v=PROTOCOL_VERSION, seq=next(self._seq), request_id=request_id))
        return reply.aborted

    # --- introspection --------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        return (await self._call(StatsRequest(v=PROTOCOL_VERSION, seq=next(self._seq)))).stats

    async def health(self) -> HealthReply:
        return await self._health()

    async def metrics_text(self) -> str:
        """The worker engine's Prometheus text (what `slipstream worker --metrics-port` serves)."""
        return (await self._call(MetricsRequest(v=PROTOCOL_VERSION, seq=next(self._seq)))).text

    async def _wire_images(self, images) -> list[bytes]:
        """Encoded off the event loop (PNG encoding and file reads take milliseconds or more); the
        worker's bound on image bytes is checked here, before anything is sent."""
        images = image_list(images)
        if not images:
            return []
        wire = await asyncio.to_thread(images_to_bytes, images)
        total, bound = sum(map(len, wire)), self.info.max_image_bytes if self.info else 0
        if bound and total > bound:
            raise InvalidRequestError(f"images: {total:,} bytes of images exceed the worker's max_image_bytes="
                                      f"{bound:,}", param="images")
        return wire

    async def _complete(self, request_id, params, **prompt) -> CompletionOutput:
        p = self._submit(request_id, params, False, prompt)
        finished = False
        try:
            item = await p.queue.get()
            finished = True
            if isinstance(item, BaseException):
                raise item
            return item
        finally:
            self._forget(p, finished)

    def _submit(self, request_id: str | None, params: SamplingParams | None, stream: bool,
                prompt: dict) -> _Pending:
        self._check_open()
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params is not None:  # values forced in behind the frozen Struct: refused as the Engine does
            params.check()
        images = prompt.get("images") or []
        if "messages" in prompt:
            tools = _tools_kw(*prompt["tools"], params) if "tools" in prompt else {}
            prompt = {"messages": check.messages(prompt["messages"]), **tools}
        else:  # token ids are range-checked by the worker, which knows the vocabulary
            prompt = {"prompt": check.prompt(prompt["prompt"], vocab_size=2**63)}
        if images:
            prompt["images"] = images
        request_id = check.request_id(request_id)
        if request_id is None:
            request_id = f"{self._id_prefix}{next(self._ids)}"
        if request_id in self._pending:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        raw = msgspec.Raw(self._enc.encode(params or SamplingParams()))
        msg = Generate(v=PROTOCOL_VERSION, request_id=request_id, params=raw, stream=stream, **prompt)
        p = _Pending(request_id, time.perf_counter())
        self._send(msg)
        self._pending[request_id] = p
        return p

    def _forget(self, p: _Pending, finished: bool) -> None:
        if self._pending.get(p.request_id) is p:
            del self._pending[p.request_id]
        if not finished and not self._closed:  # cancelled or closed early: free the worker's pages
            self._send_nowait(Abort(v=PROTOCOL_VERSION, seq=0, request_id=p.request_id))


def _tools_kw(tools, tool_choice, parallel_tool_calls, params) -> dict:
    """The Generate fields of chat's tools, checked here as the worker checks them (it checks again)."""
    request = tool_request(tools, tool_choice, parallel_tool_calls)
    if request is None:
        return {}
    if params is not None and isinstance(params, SamplingParams) and params.n > 1:
        raise InvalidRequestError("n > 1 is not available with tools; send n requests", param="n")
    return {"tools": tool_dicts(tools), "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls}

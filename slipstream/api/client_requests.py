"""A Client's requests on the wire: a prompt checked and sent as a Generate, its waiter (`Pending`)
kept by the connection until the result, and the images encoded for the wire. The Client
(slipstream/api/client.py) and its streams (client_stream.py) both go through one `ClientRequests`.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
import time

import msgspec

from slipstream import validate as check
from slipstream.api.client_connection import Pending, WorkerConnection
from slipstream.api.protocol import PROTOCOL_VERSION, Abort, Generate
from slipstream.errors import InvalidRequestError
from slipstream.images import image_list, images_to_bytes
from slipstream.outputs import CompletionOutput
from slipstream.params import SamplingParams
from slipstream.tool_calls.plan import tool_dicts
from slipstream.tool_calls.spec import tool_request


class ClientRequests:
    def __init__(self, connection: WorkerConnection):
        self.connection = connection
        self._ids = itertools.count()
        self._id_prefix = f"req-{secrets.token_hex(4)}-"  # auto ids never look like a user's "req-1"

    async def wire_images(self, images) -> list[bytes]:
        """Encoded off the event loop (PNG encoding and file reads take milliseconds or more); the
        worker's bound on image bytes is checked here, before anything is sent."""
        images = image_list(images)
        if not images:
            return []
        wire = await asyncio.to_thread(images_to_bytes, images)
        info = self.connection.info
        total, bound = sum(map(len, wire)), info.max_image_bytes if info else 0
        if bound and total > bound:
            raise InvalidRequestError(f"images: {total:,} bytes of images exceed the worker's max_image_bytes="
                                      f"{bound:,}", param="images")
        return wire

    async def complete(self, request_id, params, **prompt) -> CompletionOutput:
        p = self.submit(request_id, params, False, prompt)
        finished = False
        try:
            item = await p.queue.get()
            finished = True
            if isinstance(item, BaseException):
                raise item
            return item
        finally:
            self.forget(p, finished)

    def submit(self, request_id: str | None, params: SamplingParams | None, stream: bool,
               prompt: dict) -> Pending:
        conn = self.connection
        conn.check_open()
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params is not None:  # values forced in behind the frozen Struct: refused as the Engine does
            params.check()
        images = prompt.get("images") or []
        if "messages" in prompt:
            tools: dict = {}
            if "tools" in prompt:
                listed, choice, parallel = prompt["tools"]
                tools = tools_fields(listed, choice, parallel, params)
            prompt = {"messages": check.messages(prompt["messages"]), **tools}
        else:  # token ids are range-checked by the worker, which knows the vocabulary
            prompt = {"prompt": check.prompt(prompt["prompt"], vocab_size=2**63)}
        if images:
            prompt["images"] = images
        request_id = check.request_id(request_id)
        if request_id is None:
            request_id = f"{self._id_prefix}{next(self._ids)}"
        if request_id in conn.pending:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        raw = msgspec.Raw(conn.encode(params or SamplingParams()))
        msg = Generate(v=PROTOCOL_VERSION, request_id=request_id, params=raw, stream=stream, **prompt)
        p = Pending(request_id, time.perf_counter())
        conn.send(msg)
        conn.pending[request_id] = p
        return p

    def forget(self, p: Pending, finished: bool) -> None:
        conn = self.connection
        if conn.pending.get(p.request_id) is p:
            del conn.pending[p.request_id]
        if not finished and not conn.closed:  # cancelled or closed early: free the worker's pages
            conn.send_nowait(Abort(v=PROTOCOL_VERSION, seq=0, request_id=p.request_id))


def tools_fields(tools, tool_choice, parallel_tool_calls, params) -> dict:
    """The Generate fields of chat's tools, checked here as the worker checks them (it checks again)."""
    request = tool_request(tools, tool_choice, parallel_tool_calls)
    if request is None:
        return {}
    if params is not None and isinstance(params, SamplingParams) and params.n > 1:
        raise InvalidRequestError("n > 1 is not available with tools; send n requests", param="n")
    return {"tools": tool_dicts(tools), "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls}

"""slipstream.Client: the EngineAPI (slipstream/api/interface.py) served by a `slipstream worker`.

This file holds the API's methods. A Client holds its `WorkerConnection` (socket, handshake,
reconnection, routing replies, liveness; slipstream/api/client_connection.py, which says what a call
may count on) and its `ClientRequests` (a prompt checked and sent as a Generate, its waiter;
slipstream/api/client_requests.py), which its streams share.
"""
from __future__ import annotations

from typing import Any, Self, Sequence

from slipstream import validate as check
from slipstream.api.client_connection import WorkerConnection
from slipstream.api.client_requests import ClientRequests, tools_fields
from slipstream.api.client_stream import ClientStream
from slipstream.api.interface import DeltaStream, Messages, Prompt, ToolChoice, Tools
from slipstream.api.skills import SkillMethods
from slipstream.api.fanout import fan_out, wants_fan_out
from slipstream.api.protocol import (
    PROTOCOL_VERSION,
    Abort,
    ChatPromptRequest,
    HealthReply,
    LoadLoraRequest,
    MetricsRequest,
    StatsRequest,
    UnloadLoraRequest,
)
from slipstream.images import ImageLike
from slipstream.outputs import CompletionOutput
from slipstream.params import SamplingParams


class Client(SkillMethods):
    def __init__(self, address: str, timeout: float = 30.0, connect_timeout: float | None = None):
        self.connection = WorkerConnection(address, timeout, connect_timeout)
        self.requests = ClientRequests(self.connection)

    # --- the connection (client_connection.py) --------------------------------------------------

    async def start(self) -> Self:
        """Connect and handshake; raises WorkerUnavailableError if no worker answers in time."""
        await self.connection.start()
        return self

    async def close(self) -> None:
        await self.connection.close()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def wait_connected(self, timeout: float) -> None:
        """Wait until the connection is up again (ZMQ reconnects by itself), or raise WorkerUnavailableError."""
        await self.connection.wait_connected(timeout)

    @property
    def address(self) -> str:
        return self.connection.address

    @property
    def timeout(self) -> float:
        return self.connection.timeout

    @property
    def info(self) -> HealthReply | None:
        """The worker's answer to the handshake."""
        return self.connection.info

    @property
    def connected(self) -> bool:
        """True while a connection to a worker is up; calls made while it is down fail at once."""
        return self.connection.connected

    @property
    def draining(self) -> bool:
        """The worker announced its shutdown."""
        return self.connection.draining

    # --- requests -------------------------------------------------------------------------------

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, *, images: Sequence[ImageLike] = ()
                       ) -> CompletionOutput | list[CompletionOutput]:
        """One CompletionOutput; with params.n > 1, a list of n (fanned out here: api/fanout.py).
        `images` travel encoded (a PIL image as PNG); the worker decodes and validates them."""
        wire = await self.requests.wire_images(images)
        if wants_fan_out(params):
            return await fan_out(lambda p, rid: self.requests.complete(rid, p, prompt=prompt, images=wire), params,
                                 request_id)
        return await self.requests.complete(request_id, params, prompt=prompt, images=wire)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None, *, images: Sequence[ImageLike] = ()) -> DeltaStream:
        return ClientStream(self.requests, request_id, params, {"prompt": prompt, "images": images})

    async def chat(self, messages: Messages, params: SamplingParams | None = None,
                   request_id: str | None = None, *, images: Sequence[ImageLike] = (), tools: Tools = None,
                   tool_choice: ToolChoice = None, parallel_tool_calls: bool = True
                   ) -> CompletionOutput | list[CompletionOutput]:
        """The worker applies its model's chat template (Engine.chat), tools included."""
        tools_args = (tools, tool_choice, parallel_tool_calls)
        tools_fields(*tools_args, params)  # refused before the images are encoded
        wire = await self.requests.wire_images(images)
        if wants_fan_out(params):
            return await fan_out(lambda p, rid: self.requests.complete(rid, p, messages=messages, images=wire),
                                 params, request_id)
        return await self.requests.complete(request_id, params, messages=messages, images=wire, tools=tools_args)

    def chat_stream(self, messages: Messages, params: SamplingParams | None = None,
                    request_id: str | None = None, *, images: Sequence[ImageLike] = (), tools: Tools = None,
                    tool_choice: ToolChoice = None, parallel_tool_calls: bool = True) -> DeltaStream:
        return ClientStream(self.requests, request_id, params, {"messages": messages, "images": images,
                                                                "tools": (tools, tool_choice, parallel_tool_calls)})

    async def chat_prompt(self, messages: Messages) -> str:
        """Rendered by the worker, with its model's chat template."""
        messages = check.messages(messages)
        reply = await self.connection.call(ChatPromptRequest(v=PROTOCOL_VERSION, seq=self.connection.next_seq(),
                                                             messages=messages))
        return reply.prompt

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its waiter gets finish_reason "abort". False if unknown or finished."""
        reply = await self.connection.call(Abort(v=PROTOCOL_VERSION, seq=self.connection.next_seq(),
                                                 request_id=request_id))
        return reply.aborted

    # --- LoRA adapters (docs/lora.md) --------------------------------------------------------------

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Engine.load_lora in the worker (`path` is on the worker's machine); its refusal is raised
        here, the same error type with its `param`."""
        check.text("lora_name", name)
        check.text("lora_path", path)
        reply = await self.connection.call(LoadLoraRequest(v=PROTOCOL_VERSION, seq=self.connection.next_seq(),
                                                           lora_name=name, lora_path=path))
        return reply.adapter

    async def unload_lora(self, name: str) -> None:
        """Engine.unload_lora in the worker (LoraNotFoundError if it has none so named)."""
        check.text("lora_name", name)
        await self.connection.call(UnloadLoraRequest(v=PROTOCOL_VERSION, seq=self.connection.next_seq(),
                                                     lora_name=name))

    # --- introspection --------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        return (await self.connection.call(StatsRequest(v=PROTOCOL_VERSION, seq=self.connection.next_seq()))).stats

    async def health(self) -> HealthReply:
        return await self.connection.health()

    async def metrics_text(self) -> str:
        """The worker engine's Prometheus text (what `slipstream worker --metrics-port` serves)."""
        return (await self.connection.call(MetricsRequest(v=PROTOCOL_VERSION,
                                                          seq=self.connection.next_seq()))).text

"""The outputs of one request of an in-process Engine, on their way to its reader: the `Mailbox`
the output stage fills (deltas, the final output or an error), and the `RequestStream` that reads
it for Engine.stream / chat_stream (Engine.complete reads it too)."""
from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from slipstream.outputs import CompletionOutput, StreamDelta
from slipstream.params import SamplingParams
from slipstream.tool_calls.plan import make_plan, with_calls

if TYPE_CHECKING:
    from slipstream.api.engine import Engine
    from slipstream.scheduler.sequence import Sequence


class Mailbox:
    """A request's outputs for its single reader: put never blocks; get waits for the next item.

    What asyncio.Queue does for one producer and one consumer, with less work per item (no task
    accounting, no list of getters): the output stage puts one delta per request and pass, so at a
    few hundred streams this is paid hundreds of times a step."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: deque = deque()  # (its reader may pop what is there without awaiting `get`)
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # (a reader cancelled while waiting left it cancelled)
                waiter.set_result(None)

    async def get(self):
        while not self.items:
            await self.wait()
        return self.items.popleft()

    def wait(self) -> asyncio.Future:
        """A future done when an item is put (the reader awaits it when `items` is empty)."""
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        return waiter

    def pending(self) -> list:
        """The items not read yet, oldest first (a copy)."""
        return list(self.items)


class RequestStream:
    """The deltas of one request (Engine.stream). Not an async generator: those are closed a loop
    pass after the caller leaves them, so the request id and the pages stayed taken until then.
    Here, leaving early (break, an exception, dropping the iterator) aborts the request at once.
    Every delta it yields has text, except possibly the last (docs/api.md#streams)."""

    def __init__(self, engine: Engine, request_id: str | None, params: SamplingParams | None, prompt: dict):
        self._engine, self._args = engine, (request_id, params, prompt)
        self._seq: Sequence | None = None
        self._box: Mailbox | None = None  # the request's outputs, read here directly
        self._done = False
        self._carry: list[int] = []  # ids of tokens that produced no text yet (see _merge)
        self._tools = False  # chat with tools: deltas carry their content and tool_calls
        self._parser = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StreamDelta:
        if self._done:
            raise StopAsyncIteration
        try:
            box = self._box
            if box is None:
                request_id, params, prompt = self._args
                images, fields = prompt.get("images", ()), None
                if "messages" in prompt:
                    from slipstream.api.image_prompt import split_chat_images

                    messages, images, fields = split_chat_images(prompt["messages"], images)
                    plan = make_plan(self._engine.tokenizer, *prompt["tools"]) if "tools" in prompt else None
                    if plan is not None:
                        plan, params = plan.params(params)
                        self._tools, self._parser = True, plan.parser()
                    prompt = {"prompt": self._engine._chat_prompt(messages, plan)}
                self._seq = await self._engine._submit(prompt["prompt"], params, request_id, images=images,
                                                       fields=fields)
                box = self._box = self._seq.user.queue
            items = box.items
            while True:
                if not items:
                    await box.wait()
                    continue
                item = items.popleft()
                if type(item) is StreamDelta:
                    if self._carry or not (item.text or item.finish_reason is not None):
                        item = self._merge(item)
                        if item is None:
                            continue
                    return with_calls(item, self._parser) if self._tools else item
                elif isinstance(item, CompletionOutput):
                    self._close()
                    raise StopAsyncIteration
                else:  # the request failed: its error
                    raise item
        except BaseException:
            self._close()
            raise

    def _merge(self, delta: StreamDelta) -> StreamDelta | None:
        """A delta without text (and not the last) is held back; its token ids ride on the next one."""
        if not delta.text and delta.finish_reason is None:
            self._carry.extend(delta.token_ids)
            return None
        if self._carry:
            delta = StreamDelta(delta.request_id, delta.text, self._carry + list(delta.token_ids),
                                delta.finish_reason, delta.usage)
            self._carry = []
        return delta

    async def aclose(self) -> None:
        self._close()

    def _close(self) -> None:
        if not self._done:
            self._done = True
            if self._seq is not None:
                self._engine._forget(self._seq, finished=False)

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - at interpreter exit the loop may be gone
            pass

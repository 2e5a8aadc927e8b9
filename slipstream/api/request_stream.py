"""RequestStream: the deltas of one request of an in-process Engine (Engine.stream / chat_stream)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from slipstream.outputs import CompletionOutput, StreamDelta
from slipstream.params import SamplingParams
from slipstream.tool_calls.plan import make_plan, with_calls

if TYPE_CHECKING:
    from slipstream.api.engine import Engine
    from slipstream.scheduler.sequence import Sequence


class RequestStream:
    """The deltas of one request (Engine.stream). Not an async generator: those are closed a loop
    pass after the caller leaves them, so the request id and the pages stayed taken until then.
    Here, leaving early (break, an exception, dropping the iterator) aborts the request at once.
    Every delta it yields has text, except possibly the last (docs/api.md#streams)."""

    def __init__(self, engine: Engine, request_id: str | None, params: SamplingParams | None, prompt: dict):
        self._engine, self._args = engine, (request_id, params, prompt)
        self._seq: Sequence | None = None
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
            if self._seq is None:
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
            while True:
                item = await self._engine._next(self._seq)
                if isinstance(item, CompletionOutput):
                    self._close()
                    raise StopAsyncIteration
                item = self._merge(item)
                if item is not None:
                    return with_calls(item, self._parser) if self._tools else item
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

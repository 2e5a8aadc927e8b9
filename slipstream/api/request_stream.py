"""One request of an in-process Engine on the API side: its `RequestState` (`Sequence.user`), the
`Mailbox` the output stage fills (deltas, the final output or an error), and the `RequestStream`
that reads it for Engine.stream / chat_stream (Engine.complete reads it too)."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from slipstream.grammar.base import Matcher
from slipstream.outputs import CompletionOutput, RequestMetrics, StreamDelta
from slipstream.params import SamplingParams
from slipstream.scheduler.sequence import Sequence
from slipstream.tool_calls.parser import ToolCallParser
from slipstream.tool_calls.plan import ToolPlan, make_plan, with_calls


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


@dataclass(eq=False)
class RequestState:
    """The API side of one request; `Sequence.user` points here."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: Any  # IncrementalDetokenizer or ByteStreamDetokenizer (models/tokenizers/byte_stream.py)
    stop_token_ids: frozenset[int]
    metrics: RequestMetrics
    queue: Mailbox = field(default_factory=Mailbox)
    streaming: bool = True  # someone reads the deltas (Engine.stream); complete() waits for the output only
    pieces: list[str] = field(default_factory=list)  # text already streamed, in order
    pending: str = ""  # decoded text not streamed yet (held back while it may start a stop string)
    output: CompletionOutput | None = None
    matcher: Matcher | None = None  # grammar matcher (slipstream.grammar), advanced on each commit
    logprobs: list[float] = field(default_factory=list)
    seq: Sequence | None = None  # set by the OutputProcessor at its first token
    # output-stage bookkeeping
    processed: int = 0  # output tokens the stage has turned into text
    queued: bool = False  # in the stage's to-do list
    end_at: int | None = None  # the tick ended the request after this many output tokens
    end_reason: str | None = None
    end_drops_text: bool = False  # the last token is a stop token: its text is not output
    grammar_done_at: int | None = None  # output length at which the grammar completed
    closed: bool = False  # final output (or error) delivered
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # SamplingParams.top_logprobs > 0
    # what the tick reads for every token (set from the fields above at construction)
    token_times: list[float] = field(init=False, repr=False)  # metrics.token_times
    plain: bool = field(init=False, repr=False)  # no logprobs, no grammar, no stop strings: a token decides
    # nothing but a stop token id or max_tokens (once its first token is in)

    def __post_init__(self) -> None:
        self.token_times = self.metrics.token_times
        self.plain = not self.params.logprobs and self.matcher is None and not self.params.stop

    @property
    def text(self) -> str:
        return "".join(self.pieces) + self.pending


class Submits(Protocol):
    """What a RequestStream asks of the engine it reads (the Engine's Submitter, api/engine_submit.py)."""

    tokenizer: Any

    async def submit(self, prompt: Any, params: SamplingParams | None, request_id: str | None, streaming: bool = True,
                     images: Any = (), fields: Any = None) -> Sequence: ...

    def forget(self, seq: Sequence, finished: bool) -> None: ...

    def chat_prompt(self, messages: Any, plan: ToolPlan | None = None) -> str: ...

    async def chat_ids(self, messages: Any, plan: ToolPlan | None = None) -> list[int]: ...


class RequestStream:
    """The deltas of one request (Engine.stream). Not an async generator: those are closed a loop
    pass after the caller leaves them, so the request id and the pages stayed taken until then.
    Here, leaving early (break, an exception, dropping the iterator) aborts the request at once.
    Every delta it yields has text, except possibly the last (docs/api.md#streams)."""

    def __init__(self, submitter: Submits, request_id: str | None, params: SamplingParams | None, prompt: dict):
        self._submitter, self._args = submitter, (request_id, params, prompt)
        self._seq: Sequence | None = None
        self._box: Mailbox | None = None  # the request's outputs, read here directly
        self._done = False
        self._carry: list[int] = []  # ids of tokens that produced no text yet (see _merge)
        self._tools = False  # chat with tools: deltas carry their content and tool_calls
        self._parser: ToolCallParser | None = None

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
                    plan = make_plan(self._submitter.tokenizer, *prompt["tools"]) if "tools" in prompt else None
                    if plan is not None:
                        plan, params = plan.params(params)
                        self._tools, self._parser = True, plan.parser()
                    # (with images the text: its markers are expanded before it is tokenized)
                    prompt = {"prompt": self._submitter.chat_prompt(messages, plan) if images
                              else await self._submitter.chat_ids(messages, plan)}
                self._seq = await self._submitter.submit(prompt["prompt"], params, request_id, images=images,
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
                self._submitter.forget(self._seq, finished=False)

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - at interpreter exit the loop may be gone
            pass

"""What requests return: the final completion and streamed deltas."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import msgspec


@dataclass
class RequestMetrics:
    arrival: float  # time.perf_counter() at submission
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # commit time of each output token
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


class Usage(msgspec.Struct, frozen=True):
    """Token counts of one completion, as OpenAI's `usage` (the stop token, if sampled, counts).
    cached_tokens: prompt tokens whose KV came from the prefix cache, not computed
    (`PrefixState.num_cached_tokens`; OpenAI's `prompt_tokens_details.cached_tokens`)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cached_tokens: int = 0


class ToolCall(msgspec.Struct, frozen=True):
    """One function call the model made (chat with `tools`, docs/tools.md). `arguments` is JSON text,
    valid against the function's `parameters` schema whenever the call is complete (the request did
    not stop inside it: finish_reason "stop")."""

    id: str  # "call_..." (OpenAI's tool_call_id, which a tool message answers)
    name: str
    arguments: str

    def parsed_arguments(self) -> dict:
        return json.loads(self.arguments)


class ToolCallDelta(msgspec.Struct, frozen=True):
    """A piece of call `index` in a stream: its id and name when the call starts (arguments ""),
    then fragments of its arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class CompletionOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    logprobs: list[float] | None = None
    # per output token, SamplingParams.top_logprobs {token id: logprob}, most likely first
    top_logprobs: list[dict[int, float]] | None = None
    index: int = 0  # which of the request's SamplingParams.n completions this is
    usage: Usage | None = None  # filled from the token lists when not given (also on decoding from the wire)
    # the carried values: output token index -> the head values that token carried (its grammar's
    # carry tokens; docs/moondream.md, "The carry"); None when the request's grammar has no carry tokens
    carried: dict[int, list[float]] | None = None
    # chat with `tools` (docs/tools.md): `text` split into the answer's text (`content`) and the calls;
    # both None when the request had no tools
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    def __post_init__(self) -> None:
        if self.usage is None:
            p, c = len(self.prompt_token_ids), len(self.token_ids)
            self.usage = Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


@dataclass
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta
    usage: Usage | None = None  # set on the last delta (a streamed request's usage, cached_tokens included)
    # chat_stream with `tools`: the part of `text` that is the answer's text, and what it added to the calls
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

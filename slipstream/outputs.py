"""What requests return: the final completion and streamed deltas."""
from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class CompletionOutput:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    logprobs: list[float] | None = None


@dataclass
class StreamDelta:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last delta

"""What the tick needs from request-side output processing (implemented by the API layer).

The scheduler hands each committed token to `accept` (on the tick: keep it constant-time), and
ends requests with `abort` or `fail`; the sink decides what a token means for the request and calls
the `finish` callback it was bound to when the request is done — on the tick for what token ids
decide, or later from its output stage (`run_stage`, a task the EngineLoop runs beside the tick)
for what the text decides (stop strings). So the dependency points one way:
api → scheduler → runtime → models.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from slipstream.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from slipstream.faults import FaultInjector

Finish = Callable[[Sequence, str], bool]  # Pipeline.finish: mark finished, release when possible


class OutputSink(Protocol):
    faults: FaultInjector | None  # tests only
    commit_time: float  # perf_counter of the commit being applied (set by the EngineLoop): token times
    token_observers: list  # fn(token_times, start, end, arrival, prompt_len) per processed range (tools)
    pass_observers: list  # fn([(RequestMetrics, start, end, prompt_len), ...]) once per pass (metrics)

    def bind(self, finish: Finish) -> None:
        """Called once by the EngineLoop that owns the sink."""

    def accept(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float] | None = None,
               tops: list[dict[int, float] | None] | None = None) -> None:
        """A commit's tokens of live (not finished) sequences, once per commit: `tokens[i]` is
        `seqs[i]`'s; `logprobs` None when no row asked for them; `tops[i]` its top_logprobs
        alternatives {token id: logprob}, most likely first, when its request asked for them. A
        request whose processing fails is failed alone."""

    def abort(self, seq: Sequence) -> None:
        """End the request with finish_reason "abort"."""

    def fail(self, seq: Sequence, error: BaseException) -> None:
        """End the request with an error (its waiter raises it); the batch goes on."""

    async def run_stage(self) -> None:
        """Output processing beside the tick (text, stop strings, delivery); runs while the loop runs."""

    def process_pending(self) -> None:
        """Finish what the stage has not processed yet (the loop is stopping)."""

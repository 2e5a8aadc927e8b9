"""What the tick needs from request-side output processing (implemented by the API layer).

The scheduler hands each committed token to `accept`, and ends requests with `abort` or `fail`;
the sink decides what a token means for the request (text, stops, streaming) and calls the
`finish` callback it was bound to when the request is done. So the dependency points one way:
api → scheduler → runtime → models.
"""
from __future__ import annotations

from typing import Callable, Protocol

from slipstream.scheduler.sequence import Sequence

Finish = Callable[[Sequence, str], bool]  # Pipeline.finish: mark finished, release when possible


class OutputSink(Protocol):
    faults: object  # tests only: a slipstream.faults.FaultInjector, or None

    def bind(self, finish: Finish) -> None:
        """Called once by the EngineLoop that owns the sink."""

    def accept(self, seq: Sequence, token: int, logprob: float = 0.0) -> None:
        """A committed token of a live (not finalized) sequence."""

    def abort(self, seq: Sequence) -> None:
        """End the request with finish_reason "abort"."""

    def fail(self, seq: Sequence, error: BaseException) -> None:
        """End the request with an error (its waiter raises it); the batch goes on."""

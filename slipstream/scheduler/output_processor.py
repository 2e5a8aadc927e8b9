"""Commit-side request logic: append a token, detokenise incrementally, check stops, emit deltas.

Runs on the event loop inside commit. Text is streamed as it becomes final: while stop strings
are set, the last (longest stop - 1) characters are held back, since they may turn out to be the
start of a stop string that must not be shown.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from slipstream.errors import SlipstreamError
from slipstream.outputs import CompletionOutput, RequestMetrics, StreamDelta
from slipstream.params import SamplingParams
from slipstream.scheduler.sequence import Sequence


@dataclass(eq=False)
class RequestState:
    """The API side of one request; `Sequence.user` points here."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: object  # IncrementalDetokenizer
    stop_token_ids: frozenset[int]
    metrics: RequestMetrics
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    text: str = ""
    emitted: int = 0  # characters of `text` already streamed
    output: CompletionOutput | None = None
    matcher: object | None = None  # grammar matcher (slipstream.grammar), advanced on each commit
    logprobs: list[float] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, finalize):
        self._finalize = finalize  # Pipeline.finalize: marks finished, releases when possible

    def accept(self, seq: Sequence, token: int, logprob: float = 0.0) -> None:
        req: RequestState = seq.user
        now = time.perf_counter()
        seq.output_ids.append(token)
        if req.params.logprobs:
            req.logprobs.append(logprob)
        req.metrics.token_times.append(now)
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        reason, truncated = None, False
        if req.matcher is not None:
            try:
                req.matcher.accept(token)
            except Exception as e:  # noqa: BLE001 - a plugin may raise anything; only its request fails
                self.fail(seq, e)
                return
        if token in req.stop_token_ids:
            reason = "stop"  # the stop token stays in token_ids; its text is not part of the output
        else:
            before = len(req.text)
            req.text += req.detok.push([token])
            stops = req.params.stop
            if stops:  # only the tail can hold a new match: no rescan of the whole text
                start = max(0, before - max(map(len, stops)) + 1)
                hits = [i for i in (req.text.find(s, start) for s in stops) if i >= 0]
                if hits:
                    req.text, reason, truncated = req.text[: min(hits)], "stop", True
        if reason is None and req.matcher is not None and req.matcher.is_terminated():
            reason = "stop"  # the grammar is complete: nothing more may follow
        if reason is None and len(seq.output_ids) >= seq.max_tokens:
            reason = "length"
        if reason is None:
            self._emit(req, [token], None)
        else:
            self._finish(seq, reason, [token], flush=not truncated)

    def abort(self, seq: Sequence) -> None:
        self._finish(seq, "abort", [], flush=True)

    def fail(self, seq: Sequence, error: BaseException) -> None:
        """Fail one request (its waiter raises `error`); the batch goes on."""
        if not self._finalize(seq, "abort"):
            return
        req: RequestState = seq.user
        req.metrics.finished = time.perf_counter()
        if not isinstance(error, SlipstreamError):
            from slipstream.errors import GrammarError

            wrapped = GrammarError(f"grammar failed for request {req.request_id}: {error!r}")
            wrapped.__cause__ = error
            error = wrapped
        req.queue.put_nowait(error)

    def _finish(self, seq: Sequence, reason: str, token_ids: list[int], flush: bool) -> None:
        if not self._finalize(seq, reason):
            return
        req: RequestState = seq.user
        if flush:
            req.text += req.detok.flush()
        req.metrics.finished = time.perf_counter()
        self._emit(req, token_ids, reason)
        req.output = CompletionOutput(
            request_id=req.request_id,
            text=req.text,
            token_ids=list(seq.output_ids),
            finish_reason=reason,
            prompt_token_ids=req.prompt_ids,
            metrics=req.metrics,
            logprobs=list(req.logprobs) if req.params.logprobs else None,
        )
        req.queue.put_nowait(req.output)

    def _emit(self, req: RequestState, token_ids: list[int], finish_reason: str | None) -> None:
        hold = 0 if finish_reason or not req.params.stop else max(map(len, req.params.stop)) - 1
        upto = max(req.emitted, len(req.text) - hold)
        delta = req.text[req.emitted : upto]
        req.emitted = upto
        if delta or token_ids or finish_reason:
            req.queue.put_nowait(StreamDelta(req.request_id, delta, token_ids, finish_reason))

"""Commit-side request logic: append a token, detokenise incrementally, check stops, emit deltas.

Runs on the event loop inside commit. Text is streamed as it becomes final: while stop strings
are set, the last (longest stop - 1) characters are held back (`pending`), since they may turn out
to be the start of a stop string that must not be shown. Emitted text is kept as a list of pieces
and joined once at the end: appending to one growing string would copy it on every token.

A failure while processing one request (its detokeniser, its grammar matcher) fails only that
request (`fail`); the batch goes on.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from slipstream.errors import GrammarError, GrammarMatchError, RequestFailedError, SlipstreamError
from slipstream.outputs import CompletionOutput, RequestMetrics, StreamDelta
from slipstream.params import SamplingParams
from slipstream.scheduler.output_sink import Finish
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
    pieces: list[str] = field(default_factory=list)  # text already streamed, in order
    pending: str = ""  # decoded text not streamed yet (held back while it may start a stop string)
    output: CompletionOutput | None = None
    matcher: object | None = None  # grammar matcher (slipstream.grammar), advanced on each commit
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # SamplingParams.top_logprobs > 0

    @property
    def text(self) -> str:
        return "".join(self.pieces) + self.pending


class OutputProcessor:
    """The API layer's OutputSink (slipstream/scheduler/output_sink.py)."""

    def __init__(self) -> None:
        self._finalize: Finish | None = None  # Pipeline.finish, bound by the EngineLoop
        self.faults = None  # tests only: a slipstream.faults.FaultInjector

    def bind(self, finish: Finish) -> None:
        self._finalize = finish

    def accept(self, seq: Sequence, token: int, logprob: float = 0.0, top: dict[int, float] | None = None) -> None:
        """top: the step's SamplingParams.top_logprobs alternatives {token id: logprob}, most likely first."""
        req: RequestState = seq.user
        now = time.perf_counter()
        seq.output_ids.append(token)
        if req.params.logprobs:
            req.logprobs.append(logprob)
        if req.params.top_logprobs:
            req.top_logprobs.append(top or {})
        req.metrics.token_times.append(now)
        if req.metrics.first_token is None:
            req.metrics.first_token = now
        reason, truncated = None, False
        if req.matcher is not None:
            try:
                if self.faults is not None:
                    self.faults.check("matcher", req.request_id)
                req.matcher.accept(token)
            except Exception as e:  # noqa: BLE001 - a plugin may raise anything; only its request fails
                self.fail(seq, _as_grammar_error(req, e))
                return
        if token in req.stop_token_ids:
            reason = "stop"  # the stop token stays in token_ids; its text is not part of the output
        else:
            before = len(req.pending)
            try:
                if self.faults is not None:
                    self.faults.check("detokenize", req.request_id)
                req.pending += req.detok.push([token])
            except Exception as e:  # noqa: BLE001 - a tokenizer bug must not stop the batch
                self.fail(seq, _wrap(RequestFailedError, f"detokenising token {token} of request "
                                                         f"{req.request_id} failed: {e!r}", e))
                return
            stops = req.params.stop
            # only the held-back tail can hold a new match (no rescan of the whole text); as in vLLM,
            # stop strings end nothing before min_tokens
            if stops and len(seq.output_ids) >= req.params.min_tokens:
                start = max(0, before - max(map(len, stops)) + 1)
                hits = [i for i in (req.pending.find(s, start) for s in stops) if i >= 0]
                if hits:
                    req.pending, reason, truncated = req.pending[: min(hits)], "stop", True
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
        """Fail one request (its waiter raises `error`, a SlipstreamError); the batch goes on."""
        if not self._finalize(seq, "abort"):
            return
        req: RequestState = seq.user
        req.metrics.finished = time.perf_counter()
        if not isinstance(error, SlipstreamError):
            error = _wrap(RequestFailedError, f"request {req.request_id} failed: {error!r}", error)
        req.queue.put_nowait(error)

    def _finish(self, seq: Sequence, reason: str, token_ids: list[int], flush: bool) -> None:
        if seq.finalized:
            return
        req: RequestState = seq.user
        if flush:
            try:
                req.pending += req.detok.flush()
            except Exception as e:  # noqa: BLE001 - as in accept: only this request fails
                self.fail(seq, _wrap(RequestFailedError, f"detokenising request {req.request_id} failed: {e!r}", e))
                return
        self._finalize(seq, reason)
        req.metrics.finished = time.perf_counter()
        self._emit(req, token_ids, reason)
        req.output = CompletionOutput(
            request_id=req.request_id,
            text="".join(req.pieces),
            token_ids=list(seq.output_ids),
            finish_reason=reason,
            prompt_token_ids=req.prompt_ids,
            metrics=req.metrics,
            logprobs=list(req.logprobs) if req.params.logprobs else None,
            top_logprobs=list(req.top_logprobs) if req.params.top_logprobs else None,
        )
        req.queue.put_nowait(req.output)

    def _emit(self, req: RequestState, token_ids: list[int], finish_reason: str | None) -> None:
        hold = 0 if finish_reason or not req.params.stop else max(map(len, req.params.stop)) - 1
        delta = ""
        if len(req.pending) > hold:
            cut = len(req.pending) - hold
            delta, req.pending = req.pending[:cut], req.pending[cut:]
            req.pieces.append(delta)
        if delta or token_ids or finish_reason:
            req.queue.put_nowait(StreamDelta(req.request_id, delta, token_ids, finish_reason))


def _wrap(cls: type[SlipstreamError], message: str, cause: BaseException) -> SlipstreamError:
    error = cls(message)
    error.__cause__ = cause
    return error


def _as_grammar_error(req: RequestState, error: BaseException) -> SlipstreamError:
    if isinstance(error, GrammarError):
        return error
    return _wrap(GrammarMatchError, f"grammar matcher of request {req.request_id} failed: {error!r}", error)

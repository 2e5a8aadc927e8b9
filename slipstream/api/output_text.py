"""The output stage's text phase: detokenise a request's new tokens and find what ends it.

`TextPhase` is the half of a pass (slipstream/api/output_processor.py) that may run on the stage's
worker thread (EngineConfig(output_stage="thread")): `_texts` reads the tick's state only through
the `Work` snapshot the loop took when the pass started, and writes only the request's text state
(its detokeniser and `pending`, the decoded text not streamed yet), which nothing else touches
until the loop delivers the pass (`OutputProcessor._apply`). Its answer is an `Outcome`: the tokens
it covered and what, if anything, ends the request; a failure is carried in it, so one request's
detokeniser fails only that request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast
from slipstream.api.request_stream import RequestState
from slipstream.errors import RequestFailedError, SlipstreamError
from slipstream.faults import FaultInjector


class TextPhase:
    """The text phase's methods, a base of OutputProcessor."""

    faults: FaultInjector | None  # OutputProcessor's fault injector (tests only)

    def _texts_of(self, work: list["Work"]) -> list["Outcome"]:
        return [self._texts(*w) for w in work]

    def _texts(self, req: RequestState, start: int, tokens: list[int], end_at: int | None, end_reason: str | None,
               drops_text: bool, grammar_done_at: int | None, max_tokens: int) -> "Outcome":
        """Text phase: detokenise the snapshot's tokens (output tokens from `start`) and find what
        ends the request, if anything. Reads only its arguments and writes only the request's text
        state (so it may run in a thread: EngineConfig.output_stage)."""
        try:
            if req.params.stop:
                return self._scan_stops(req, start, tokens, end_at, end_reason, grammar_done_at, max_tokens)
            self._push(req, tokens[:-1] if drops_text and tokens else tokens)
            return Outcome(start, start + len(tokens), end_reason if end_at is not None else None, flush=True)
        except RequestFailed as f:
            return Outcome(start, start, error=f.error)
        except Exception as e:  # noqa: BLE001 - a bug processing one request must not stop the stage
            return Outcome(start, start, error=wrap_error(RequestFailedError, f"processing the output of request "
                                                                          f"{req.request_id} failed: {e!r}", e))

    def _scan_stops(self, req: RequestState, start: int, tokens: list[int], end_at: int | None, end_reason: str | None,
                    grammar_done_at: int | None, max_tokens: int) -> "Outcome":
        """Token by token: the first of stop token, stop string, finished grammar, max_tokens ends it."""
        stops = cast(tuple[str, ...], req.params.stop)  # (SamplingParams normalises it to a tuple)
        longest = max(map(len, stops))
        for i, token in enumerate(tokens, start):
            reason, truncated = None, False
            if token in req.stop_token_ids:
                reason = "stop"
            else:
                before = len(req.pending)
                self._push(req, [token])
                at = max(0, before - longest + 1)  # only the held-back tail can hold a new match
                hits = [j for j in (req.pending.find(s, at) for s in stops) if j >= 0]
                if hits and i + 1 >= req.params.min_tokens:  # as in vLLM: none ends the output earlier
                    req.pending, reason, truncated = req.pending[:min(hits)], "stop", True
            n = i + 1
            if reason is None and (grammar_done_at == n or end_at == n):
                reason = end_reason if end_at == n else "stop"
            if reason is None and n >= max_tokens:
                reason = "length"
            if reason is not None:
                return Outcome(start, n, reason, flush=not truncated)
        limit = start + len(tokens)
        if end_at is not None and end_at <= limit:  # ended (an abort) with nothing left to scan
            return Outcome(start, limit, end_reason)
        return Outcome(start, limit, None)

    def _push(self, req: RequestState, tokens: list[int]) -> None:
        if not tokens:
            return
        try:
            if self.faults is not None:
                self.faults.check("detokenize", req.request_id)
            req.pending += req.detok.push(tokens)
        except Exception as e:  # noqa: BLE001 - a tokenizer bug must not stop the batch
            raise RequestFailed(wrap_error(RequestFailedError, f"detokenising tokens {tokens} of request "
                                                           f"{req.request_id} failed: {e!r}", e)) from e


# One request's share of a pass, taken on the loop when the pass starts: (request, start, tokens,
# end_at, end_reason, drops_text, grammar_done_at, max_tokens) — the output tokens from `start` to
# process (a copy: the tick appends to the original) and the tick's end marks as they were then.
# The tick goes on appending tokens and ending requests meanwhile; the text phase sees none of it
# (a field read live could show a stop token appended but not yet marked: its text would leak into
# the output). A plain tuple: a pass builds one per request, and a frozen dataclass doubled the
# cost of a 512-request pass (_process, the loop stage, passes the same fields as arguments).
Work = tuple


@dataclass
class Outcome:
    """What the text phase found for one request: tokens start..end processed, and what ends it."""

    start: int
    end: int
    reason: str | None = None  # the request ends after token `end`
    flush: bool = True  # flush the detokeniser at the end (not after a stop string cut the text)
    error: SlipstreamError | None = None


class RequestFailed(Exception):
    def __init__(self, error: SlipstreamError):
        self.error = error


def wrap_error(cls: type[SlipstreamError], message: str, cause: BaseException) -> SlipstreamError:
    error = cls(message)
    error.__cause__ = cause
    return error

"""Request-side output processing, split in two so the tick stays short.

On the tick (`accept`, called once per commit with its live rows): append each token, time it,
queue the request for the stage; and only for the rows it concerns, advance the grammar matcher
(the next mask depends on it), keep logprobs, and end the request when a token id decides it — a
stop token id, a finished grammar, max_tokens. Constant work per row, no text.

Off the tick (the output stage: `run_stage`, a task beside the engine loop; `process_pending`
when the loop stops): detokenise the tokens committed since the last pass, scan stop strings, stream
one delta per request per pass and emit final outputs. A request with stop strings is ended here,
by the text: a stop string found here ends the sequence a tick or more after its token was
committed, so later tokens of it may already be in flight — zombies make that safe, and its output
is cut back to the stop, so text and token ids equal what a blocking loop would give.

A pass has two phases: the text phase (`_texts`: detokenise, scan stops; slipstream/api/output_text.py,
which holds it and says what it may read and write) and the delivery phase (`_apply`: end the
sequence, cut, stream, finish), which this file holds with the tick's side and the stage's
scheduling. A request without stop strings that nothing ended is passed in one step on the loop
(detokenise its new tokens, stream them): the common case. With EngineConfig(output_stage="thread")
the text phase of a whole pass runs on a
worker thread while the loop goes on ticking; delivery always runs on the loop (asyncio queues,
scheduler state). When the loop stops, `process_pending` first delivers the thread's pass in
flight (waiting for it, or running it on the loop if the thread never started it), then processes
the rest: no request is detokenised twice and no pass is dropped.

Text is kept as streamed pieces plus a held-back tail (`pending`: while stop strings are set, the
last longest-stop - 1 characters may start a stop string). A failure processing one request (its
detokeniser, its grammar matcher) fails only that request.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from slipstream.api.output_text import Outcome, RequestFailed, TextPhase, Work, wrap_error
from slipstream.api.request_stream import RequestState
from slipstream.faults import FaultInjector
from slipstream.errors import GrammarError, GrammarMatchError, PipelineInvariantError, RequestFailedError, SlipstreamError
from slipstream.outputs import CompletionOutput, RequestMetrics, StreamDelta, Usage
from slipstream.scheduler.output_sink import Finish
from slipstream.scheduler.sequence import Sequence

log = structlog.get_logger(__name__)
STAGE_SLICE = 64  # requests processed between two looks at the clock
# the most CPU time a pass takes before it yields to the loop (a tick may be waiting): the loop
# thread's clock, so a process the machine deschedules mid-pass does not yield for time it never had
STAGE_SLICE_S = 0.001


def _unbound(seq: Sequence, reason: str) -> bool:
    raise PipelineInvariantError("the output processor is not bound to an engine loop")


class OutputProcessor(TextPhase):
    """The API layer's OutputSink (slipstream/scheduler/output_sink.py) and its output stage."""

    def __init__(self, text_thread: bool = False) -> None:
        self._finish: Finish = _unbound  # the EngineLoop's finish, bound by it
        # EngineConfig(output_stage="thread"): the text phase of each pass runs on this thread
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="slipstream-output") if text_thread else None
        self.faults: FaultInjector | None = None  # tests only
        self._todo: list[RequestState] = []
        self._inflight: tuple[list[Work], Future] | None = None  # the thread's pass, not delivered yet
        self.commit_time = 0.0  # set by the EngineLoop before each commit: the time of every token in it
        self._ready: asyncio.Event | None = None
        # fn(token_times, start, end, arrival, prompt_len) per request and pass, off the tick (tools)
        self.token_observers: list = []
        # fn([(RequestMetrics, start, end, prompt_len), ...]) once per pass (metrics): what each request's
        # output tokens start..end were; collected in `_ranges` while the pass runs
        self.pass_observers: list = []
        self._ranges: list[tuple[RequestMetrics, int, int, int]] = []
        # fn(reason) once per request, with the finish_reason its caller sees ("abort" for an error):
        # counted here, not where the tick ends a sequence, since a stop string found by the stage
        # can still win over an abort that ended the sequence first (metrics)
        self.finish_observers: list = []

    def bind(self, finish: Finish) -> None:
        self._finish = finish

    # --- on the tick ----------------------------------------------------------------------------

    def accept(self, seqs: list[Sequence], tokens: list[int], logprobs: list[float] | None = None,
               tops: list[dict[int, float] | None] | None = None) -> None:
        """One commit's live rows: `tokens[i]` is `seqs[i]`'s token, `logprobs` (None: no row asked)
        its logprob, `tops` its top_logprobs alternatives {token id: logprob}, most likely first. A
        row's processing that raises fails only its request."""
        now, todo, queued = self.commit_time, self._todo, False
        for i, seq in enumerate(seqs):  # the hot loop: a plain row is an append, a time and a queue
            req: RequestState = seq.user
            token = tokens[i]
            out = seq.output_ids
            out.append(token)
            req.token_times.append(now)
            if not req.queued:
                req.queued = queued = True
                todo.append(req)
            if req.plain and req.seq is not None and token not in req.stop_token_ids and len(out) < seq.max_tokens:
                continue
            try:
                self._decide(seq, req, token, 0.0 if logprobs is None else logprobs[i], None if tops is None else tops[i])
            except PipelineInvariantError:
                raise
            except Exception as e:  # noqa: BLE001 - one request's processing failed: only it fails
                log.warning("commit_request_failed", request_id=seq.request_id, error=repr(e))
                self.fail(seq, e)
        if queued and self._ready is not None:
            self._ready.set()

    def _decide(self, seq: Sequence, req: RequestState, token: int, logprob: float, top: dict[int, float] | None) -> None:
        """What a committed token means beyond its append: the first token, logprobs, the grammar,
        and the end of the request when a token id decides it."""
        out = seq.output_ids
        m = req.metrics
        if m.first_token is None:
            m.first_token = self.commit_time
            req.seq = seq
        if req.params.logprobs:
            req.logprobs.append(logprob)
            if req.params.top_logprobs:
                req.top_logprobs.append(top or {})
        matcher = req.matcher
        if matcher is not None:
            try:
                if self.faults is not None:
                    self.faults.check("matcher", req.request_id)
                matcher.accept(token)
            except Exception as e:  # noqa: BLE001 - a plugin may raise anything; only its request fails
                self.fail(seq, _as_grammar_error(req, e))
                return
            if req.grammar_done_at is None and matcher.is_terminated():
                req.grammar_done_at = len(out)
        if req.params.stop:
            return  # ended by the output stage, which sees the text
        if token in req.stop_token_ids:
            self._end(seq, req, "stop", drops_text=True)  # the stop token stays in token_ids, not in the text
        elif req.grammar_done_at is not None:
            self._end(seq, req, "stop")  # the grammar is complete: nothing more may follow
        elif len(out) >= seq.max_tokens:
            self._end(seq, req, "length")

    def _end(self, seq: Sequence, req: RequestState, reason: str, drops_text: bool = False) -> None:
        req.end_at, req.end_reason, req.end_drops_text = len(seq.output_ids), reason, drops_text
        self._finish(seq, reason)

    def abort(self, seq: Sequence) -> None:
        if seq.finished:
            return
        req: RequestState = seq.user
        req.seq = seq
        self._end(seq, req, "abort")
        if not req.queued:
            self._queue(req)

    def _queue(self, req: RequestState) -> None:
        """Put a request on the output stage's to-do list (once until the stage processes it)."""
        req.queued = True
        self._todo.append(req)
        if self._ready is not None:
            self._ready.set()

    def fail(self, seq: Sequence, error: BaseException) -> None:
        """Fail one request (its waiter raises `error`, a SlipstreamError); the batch goes on. A
        request the tick already ended (its output complete, the stage yet to deliver it) keeps it."""
        req: RequestState = seq.user
        if req.closed or (seq.finished and req.end_at is not None):
            return
        self._finish(seq, "abort")
        self._deliver_error(req, error)

    def _deliver_error(self, req: RequestState, error: BaseException) -> None:
        req.closed, req.seq = True, None  # (seq.user points back here: no cycle left for the collector)
        for observe in self.finish_observers:
            observe("abort")
        req.metrics.finished = time.perf_counter()
        if not isinstance(error, SlipstreamError):
            error = wrap_error(RequestFailedError, f"request {req.request_id} failed: {error!r}", error)
        req.queue.put_nowait(error)

    # --- the output stage -----------------------------------------------------------------------

    async def run_stage(self) -> None:
        """The stage as a task on the engine's loop: a pass whenever commits left work, yielding to
        the loop once it has taken STAGE_SLICE_S of CPU (so one pass covers every request a step
        committed, and a tick waits about that long for it at most)."""
        self._ready = asyncio.Event()
        if self._todo:
            self._ready.set()
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._pool is not None:
                await self._threaded_pass()
                continue
            # (work stays in self._todo until processed: if the loop stops between slices,
            # process_pending finds it there)
            t0 = time.thread_time()
            while self._todo:
                todo, self._todo = self._todo[:STAGE_SLICE], self._todo[STAGE_SLICE:]
                for req in todo:
                    self._process(req)
                self._end_pass()
                # an idle stage must not keep its last requests (prompt, output, queue) alive
                del todo, req
                if self._todo and time.thread_time() - t0 >= STAGE_SLICE_S:
                    await asyncio.sleep(0)
                    t0 = time.thread_time()

    async def _threaded_pass(self) -> None:
        """The text phase of every queued request on the worker thread, then delivery here. While the
        thread works the tick goes on (appending tokens, ending requests): each request's outcome
        covers the snapshot it was given, later tokens wait for the next pass."""
        todo, self._todo = self._todo, []
        work = []
        for req in todo:
            req.queued = False
            if not req.closed and req.seq is not None:
                work.append(self._snapshot(req, req.seq))
        assert self._pool is not None  # (a threaded pass only with text_thread)
        future = self._pool.submit(self._texts_of, work)
        self._inflight = (work, future)
        try:
            await asyncio.wrap_future(future)
        finally:  # also when cancelled (the loop is stopping): deliver the pass, never drop it
            self._deliver_inflight()

    def _deliver_inflight(self) -> None:
        """Deliver the thread's pass on the loop, once (the stage or process_pending, whichever comes first)."""
        if self._inflight is None:
            return
        work, future = self._inflight
        self._inflight = None
        # cancel() succeeds only if the thread never started it: then the loop runs the text phase
        outcomes = self._texts_of(work) if future.cancel() else future.result()
        for w, outcome in zip(work, outcomes):
            self._apply(w[0], outcome)
        self._end_pass()

    def close(self) -> None:
        """The engine closed (its loop stopped, the last pass delivered): the text thread ends."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    def process_pending(self) -> None:
        """One synchronous pass (when the engine loop stops, for what the stage had not reached). The
        thread's pass in flight goes first: its requests' next tokens start where it ended."""
        self._deliver_inflight()
        todo, self._todo = self._todo, []
        for req in todo:
            self._process(req)
        self._end_pass()

    def _process(self, req: RequestState) -> None:
        """Both phases on the loop. The snapshot is passed as arguments, not built as a Work (as
        _snapshot does for the thread): the tuple and the call through it cost a 512-request pass
        10–15% (tools/serving/bench_stage_pass.py)."""
        req.queued = False
        seq = req.seq
        if req.closed or seq is None:
            return
        out, end_at, start = seq.output_ids, req.end_at, req.processed
        if end_at is None and not req.params.stop and self.faults is None:  # nothing ends it here: push, stream
            tokens = out[start:]
            if not tokens:
                return
            try:
                text = req.detok.push(tokens)
            except Exception as e:  # noqa: BLE001 - as in _push: only this request fails
                self._finish(seq, "abort")
                self._deliver_error(req, wrap_error(RequestFailedError, f"detokenising tokens {tokens} of request "
                                                                   f"{req.request_id} failed: {e!r}", e))
                return
            req.processed = end = start + len(tokens)
            if text:
                req.pieces.append(text)  # (nothing is held back without stop strings: `pending` stays empty)
            if req.streaming:
                req.queue.put_nowait(StreamDelta(req.request_id, text, tokens))
            if self.pass_observers:  # (self._observe, spelled out: the common case of every pass)
                self._ranges.append((req.metrics, start, end, len(req.prompt_ids)))
            for observe in self.token_observers:
                observe(req.metrics.token_times, start, end, req.metrics.arrival, len(req.prompt_ids))
            return
        self._apply(req, self._texts(req, start, out[start:len(out) if end_at is None else end_at], end_at,
                                     req.end_reason, req.end_drops_text, req.grammar_done_at, seq.max_tokens))

    @staticmethod
    def _snapshot(req: RequestState, seq: Sequence) -> "Work":
        """On the loop, between commits: what the text phase may know of the tick's state (the
        arguments of _texts, as _process passes them)."""
        out, end_at, start = seq.output_ids, req.end_at, req.processed
        return (req, start, out[start:len(out) if end_at is None else end_at], end_at, req.end_reason,
                req.end_drops_text, req.grammar_done_at, seq.max_tokens)

    def _apply(self, req: RequestState, o: "Outcome") -> None:
        """Delivery phase (on the loop): end the sequence if the text decided it, stream, finish."""
        if req.closed:
            return
        seq = req.seq
        assert seq is not None  # (snapshot only once the request has its first token)
        if o.error is not None:
            self._finish(seq, "abort")
            self._deliver_error(req, o.error)
            return
        req.processed = o.end
        out = seq.output_ids
        try:
            if o.reason is None:
                self._emit(req, out[o.start:o.end], None)
            else:
                self._finish(seq, o.reason)  # (no-op if the tick or an abort ended it already)
                if len(out) > o.end:  # tokens committed after a stop string are not part of the output
                    del out[o.end:]
                    del req.logprobs[o.end:]
                    del req.top_logprobs[o.end:]
                    del req.metrics.token_times[o.end:]
                self._close(seq, req, o.reason, out[o.start:o.end], flush=o.flush)
        except RequestFailed as f:
            self._finish(seq, "abort")
            self._deliver_error(req, f.error)
            return
        self._observe(req, o.start, o.end)

    def _observe(self, req: RequestState, start: int, end: int) -> None:
        """Output tokens start..end of a request were processed (per-token metrics, off the tick)."""
        if self.pass_observers:
            self._ranges.append((req.metrics, start, end, len(req.prompt_ids)))
        for observe in self.token_observers:
            observe(req.metrics.token_times, start, end, req.metrics.arrival, len(req.prompt_ids))

    def _end_pass(self) -> None:
        """After a pass (or a slice of one): its processed ranges to the pass observers, in one call."""
        ranges, self._ranges = self._ranges, []
        if ranges:
            for observe in self.pass_observers:
                observe(ranges)

    def _close(self, seq: Sequence, req: RequestState, reason: str, token_ids: list[int], flush: bool) -> None:
        if flush:
            try:
                req.pending += req.detok.flush()
            except Exception as e:  # noqa: BLE001 - as in _push: only this request fails
                raise RequestFailed(wrap_error(RequestFailedError, f"detokenising request {req.request_id} "
                                                               f"failed: {e!r}", e)) from e
        req.closed, req.seq = True, None  # (seq.user points back here: no cycle left for the collector)
        req.metrics.finished = time.perf_counter()
        for observe in self.finish_observers:
            observe(reason)
        p, c = len(req.prompt_ids), len(seq.output_ids)
        usage = Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                      cached_tokens=seq.prefix.num_cached_tokens)
        self._emit(req, token_ids, reason, usage)
        req.output = CompletionOutput(
            request_id=req.request_id,
            text="".join(req.pieces),
            token_ids=list(seq.output_ids),
            finish_reason=reason,
            prompt_token_ids=req.prompt_ids,
            metrics=req.metrics,
            logprobs=list(req.logprobs) if req.params.logprobs else None,
            top_logprobs=list(req.top_logprobs) if req.params.top_logprobs else None,
            usage=usage,
            carried=({i: list(values) for i, (_, values) in sorted(seq.carried.items()) if i < c}
                     if seq.sampling.carry else None),
        )
        req.queue.put_nowait(req.output)

    def _emit(self, req: RequestState, token_ids: list[int], finish_reason: str | None,
              usage: Usage | None = None) -> None:
        hold = 0 if finish_reason or not req.params.stop else max(map(len, req.params.stop)) - 1
        delta = ""
        if len(req.pending) > hold:
            cut = len(req.pending) - hold
            delta, req.pending = req.pending[:cut], req.pending[cut:]
            req.pieces.append(delta)
        if req.streaming and (delta or token_ids or finish_reason):
            req.queue.put_nowait(StreamDelta(req.request_id, delta, list(token_ids), finish_reason, usage))



def _as_grammar_error(req: RequestState, error: BaseException) -> SlipstreamError:
    if isinstance(error, GrammarError):
        return error
    return wrap_error(GrammarMatchError, f"grammar matcher of request {req.request_id} failed: {error!r}", error)

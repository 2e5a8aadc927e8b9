"""The output stage's thread against the loop, interleaved deterministically (issue 27, defects 1-2).

The thread's side of a pass (`_texts` over its requests) is run by hand, between two bytecodes of
the loop's side, for every such point in turn: the tick accepting a token (which appends it, then
marks the end: end_at, end_reason, the stop-token flag, grammar_done_at) or the engine loop stopping
(which delivers what is pending). Whatever the point, the output must be the same.
"""
import asyncio
import concurrent.futures
import sys
from types import SimpleNamespace

import pytest

from slipstream import SamplingParams
from slipstream.api import output_processor as op
from slipstream.api import output_text
from slipstream.api.output_processor import OutputProcessor, RequestState
from slipstream.outputs import CompletionOutput, RequestMetrics
from slipstream.runtime.batch import SamplingRow
from slipstream.scheduler import engine_loop
from slipstream.scheduler.engine_loop import EngineLoop
from slipstream.scheduler.sequence import Sequence

TRACED = {op.__file__, output_text.__file__, engine_loop.__file__}


class _CharDetok:
    def push(self, ids):
        return "".join(map(chr, ids))

    def flush(self):
        return ""


class _ManualPool:
    """The stage's worker thread, run by hand: submit() only records the work."""

    def __init__(self):
        self.work, self.auto = [], False

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        self.work.append((future, fn, args))
        if self.auto:
            self.run_pending()
        return future

    def run_pending(self):
        while self.work:
            future, fn, args = self.work.pop(0)
            if future.set_running_or_notify_cancel():  # (False: cancelled before it ran)
                future.set_result(fn(*args))


class _Matcher:
    """A grammar that is complete once it has seen `last`."""

    def __init__(self, last):
        self.last, self.done = last, False

    def accept(self, token):
        self.done = self.done or token == self.last

    def is_terminated(self):
        return self.done


def _finish(seq, reason):
    if seq.finished:
        return False
    seq.finished, seq.finish_reason = True, reason
    return True


def _processor():
    proc = OutputProcessor(text_thread=True)
    proc._pool.shutdown()
    proc._pool = pool = _ManualPool()
    proc.bind(_finish)
    return proc, pool


def _request(rid, params, stop_ids=(), matcher=None):
    req = RequestState(rid, [1], params, _CharDetok(), frozenset(stop_ids), RequestMetrics(0.0))
    req.matcher = matcher
    return req, Sequence(rid, [1], params.max_tokens, SamplingRow(), user=req)


def _with_thread_at(k, thread_side):
    """A tracer that runs thread_side() once, before the k-th bytecode executed in the stage's or
    the engine loop's code; returns (start, stop, count of bytecodes seen, fired?)."""
    seen, fired = [0], [False]

    def local(frame, event, arg):
        if event == "opcode":
            if seen[0] == k and not fired[0]:
                fired[0] = True
                thread_side()  # (the tracer is off inside a trace function)
            seen[0] += 1
        return local

    def tracer(frame, event, arg):
        if frame.f_code.co_filename not in TRACED:
            return None
        frame.f_trace_opcodes = True
        return local

    return (lambda: sys.settrace(tracer)), (lambda: sys.settrace(None)), seen, fired


async def _turns(n=30):
    for _ in range(n):
        await asyncio.sleep(0)


def _chars(s):
    return [ord(c) for c in s]


# (params, stop token ids, grammar's last token, tokens before the pass, the token accepted while
#  the thread runs — None: an abort —, tokens fed after it while the request lives, expected output)
SCENARIOS = {
    "stop token": (SamplingParams(max_tokens=10), _chars("h"), None, "ab", "h", "xyz", ("ab", "abh", "stop")),
    "grammar complete": (SamplingParams(max_tokens=6, stop=["Z"]), (), ord("c"), "ab", "c", "def",
                         ("abc", "abc", "stop")),
    "max_tokens": (SamplingParams(max_tokens=3), (), None, "ab", "c", "", ("abc", "abc", "length")),
    "abort": (SamplingParams(max_tokens=10), (), None, "ab", None, "", ("ab", "ab", "abort")),
    "stop token, stop strings": (SamplingParams(max_tokens=10, stop=["Z"]), _chars("h"), None, "ab", "h", "xyz",
                                 ("ab", "abh", "stop")),
}


async def _tick_scenario(name, k):
    params, stop_ids, last, before, during, after, _ = SCENARIOS[name]
    proc, pool = _processor()
    req, seq = _request("r", params, stop_ids, _Matcher(last) if last is not None else None)
    stage = asyncio.create_task(proc.run_stage())
    try:
        for t in _chars(before):
            proc.accept([seq], [t])
        await _turns()
        assert len(pool.work) == 1  # the stage handed the pass to its thread, which has not run it
        start, stop, seen, fired = _with_thread_at(k, pool.run_pending)
        start()
        try:
            proc.accept([seq], [ord(during)]) if during is not None else proc.abort(seq)
        finally:
            stop()
        if not fired[0]:
            pool.run_pending()
        pool.auto = True
        await _turns()
        for t in _chars(after):
            if seq.finished:
                break
            proc.accept([seq], [t])
            await _turns()
        assert req.output is not None, f"no output (thread ran at bytecode {k})"
        return req.output, seen[0]
    finally:
        stage.cancel()
        await asyncio.gather(stage, return_exceptions=True)


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_the_text_phase_sees_a_commit_whole_wherever_the_thread_runs(name):
    """Replays defect 1: `_texts` run between the append of a stop token and the marking of the
    end used to read the new length but not end_at / the stop-token flag: text 'abh', not 'ab'."""
    text, token_ids, reason = SCENARIOS[name][-1]
    k, points = 0, 1
    while k <= points:
        out, points = await _tick_scenario(name, k)
        assert (out.text, out.token_ids, out.finish_reason) == (text, _chars(token_ids), reason), \
            f"the thread ran before bytecode {k} of {points} of the tick"
        k += 1
    assert points > 20  # the tracer saw the tick's code


class _IdlePlanner:
    running, waiting, num_waiting = [], [], 0
    prefix_cache = None

    def has_work(self):
        return False


def _engine_loop(proc):
    loop = EngineLoop(SimpleNamespace(slots=[]), _IdlePlanner(), proc, depth=2, page_size=8)
    loop.pipeline.finish = _finish
    return loop


def _outputs(req):
    return [item for item in req.queue.pending() if isinstance(item, CompletionOutput)]


async def _close_scenario(k):
    proc, pool = _processor()
    loop = _engine_loop(proc)
    task = asyncio.create_task(loop.run())
    await _turns()
    live, live_seq = _request("live", SamplingParams(max_tokens=10))
    ended, ended_seq = _request("ended", SamplingParams(max_tokens=10), _chars("h"))
    for t in _chars("ab"):
        proc.accept([live_seq], [t])
    for t in _chars("xyh"):
        proc.accept([ended_seq], [t])  # the tick ends it (stop token): only the stage's pass delivers it
    await _turns()
    assert len(pool.work) == 1  # both in the thread's pass, not run yet
    proc.abort(live_seq)  # as Engine.close does: queued again, while still in the thread's pass
    start, stop, seen, fired = _with_thread_at(k, pool.run_pending)
    start()
    try:
        loop.close()
        await task
        await _turns()  # the stage task sees its cancellation
    finally:
        stop()
    return live, ended, seen[0], fired[0]


async def test_closing_during_a_threaded_pass_neither_duplicates_nor_drops_it():
    """Defect 2: the loop's process_pending ran beside the thread's pass (a request in both was
    detokenised twice: 'abab'), and cancelling the stage cancelled a pass the thread had not
    started (its requests never got an output)."""
    k, points, never = 0, 1, False
    while k <= points + 1:
        live, ended, points, fired = await _close_scenario(k)
        never = never or not fired
        where = f"thread ran before bytecode {k} of {points} of the close" if fired else "thread never ran"
        assert [(o.text, o.finish_reason) for o in _outputs(live)] == [("ab", "abort")], where
        assert [(o.text, o.finish_reason) for o in _outputs(ended)] == [("xy", "stop")], where
        k += 1
    assert never and points > 20


async def test_closing_between_slices_of_a_loop_stage_pass_drops_nothing(monkeypatch):
    """The loop stage yields between slices of STAGE_SLICE requests (here every one); a close in
    between used to leave the rest of the pass in the cancelled stage's hands (never delivered)."""
    monkeypatch.setattr(op, "STAGE_SLICE", 1)
    monkeypatch.setattr(op, "STAGE_SLICE_S", 0.0)
    proc = OutputProcessor()
    loop = _engine_loop(proc)
    task = asyncio.create_task(loop.run())
    await _turns()
    reqs = [_request(f"r{i}", SamplingParams(max_tokens=2)) for i in range(3)]
    process = proc._process

    def closing_process(req):
        if req is reqs[0][0]:
            loop.close()  # the loop stops while the stage is at its first slice
        process(req)

    proc._process = closing_process
    for req, seq in reqs:
        for t in _chars("ab"):
            proc.accept([seq], [t])
    await task
    await _turns()
    assert [[(o.text, o.finish_reason) for o in _outputs(req)] for req, _ in reqs] == [[("ab", "length")]] * 3


async def test_a_stop_string_that_wins_over_a_later_abort_is_counted_as_stop():
    """Issue 27: the stage found a stop string (its pass still with the thread) when an abort ended
    the sequence; the caller gets finish_reason "stop", and the metric must count that, not "abort"."""
    from prometheus_client import CollectorRegistry

    from slipstream.metrics import EngineMetrics

    proc, pool = _processor()
    pipeline = SimpleNamespace(finish_observers=[])

    def finish(seq, reason):  # as Pipeline.finish: the first reason wins, observers told of it
        if not _finish(seq, reason):
            return False
        for observe in pipeline.finish_observers:
            observe(seq, reason)
        return True
    proc.bind(finish)
    metrics = EngineMetrics(CollectorRegistry(), model="m")
    metrics.attach(SimpleNamespace(planner=_IdlePlanner(), pipeline=pipeline, outputs=proc, observers=[]),
                   SimpleNamespace(num_free=0, total=0))
    req, seq = _request("r", SamplingParams(max_tokens=10, stop=["b"]))
    stage = asyncio.create_task(proc.run_stage())
    try:
        for t in _chars("ab"):
            proc.accept([seq], [t])
        await _turns()
        assert len(pool.work) == 1  # the pass that finds "b" is with the thread
        proc.abort(seq)  # ends the sequence first: the tick's reason is "abort"
        pool.run_pending()
        pool.auto = True
        await _turns()
    finally:
        stage.cancel()
        await asyncio.gather(stage, return_exceptions=True)
    assert (req.output.text, req.output.finish_reason) == ("a", "stop")

    def finished(reason):
        return metrics.registry.get_sample_value("slipstream_requests_finished_total",
                                                 {"model": "m", "finish_reason": reason})
    assert (finished("stop"), finished("abort")) == (1.0, 0.0)

"""Step tracing (off by default): host spans, device spans, and per-step records of the bubble.

Host spans come from the timestamps the engine loop already takes (plan, launch, commit and its
wait, finalize). Device spans come from the device's streams: on the CPU device each stream's
worker thread reports (label, start, end) of every labeled work item through `busy_hook`; a CUDA
runtime would report the same tuples from timing events. Every launch is tagged with the step
that issued it, so spans are attributed by step id, not by counting.

Per step k (window = start of forward k → start of forward k+1):
  period       the window's length
  forward      the forward span; sampling = sample spans + mask uploads + device→host copy
  busy         time in the window during which any device stream was running
  idle         period − busy: the bubble
  bookkeeping  host plan + launch + commit + finalize (waits excluded)
  commit_wait  host time awaiting the step's device→host copy; period − commit_wait is the host's own
               time per step (`host_active`: bookkeeping plus the loop's untraced overhead)
Steps are derived one commit late (step k needs forward k+1's start). A step followed by an idle
engine (nothing to run) is marked `contiguous=False` and left out of metrics and benchmarks.
Storage is bounded, so tracing can stay on in a long-running server.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

HOST_LANES = ("plan", "launch", "commit", "finalize")
DEVICE_LANES = ("forward", "sample", "copy")  # "copy" = h2d mask uploads and the d2h copy


class DeviceSpan(NamedTuple):
    stream: str
    label: str  # forward | sample | h2d | d2h
    start: float  # perf_counter seconds, the host clock
    end: float
    step: int


class HostSpan(NamedTuple):
    lane: str  # plan | launch | commit_wait | commit | finalize
    step: int
    start: float
    end: float


@dataclass
class HostStep:
    """Host timestamps of one step, from the loop's step timings."""

    step_id: int
    kind: str
    num_seqs: int
    num_tokens: int
    slot: int
    t_plan: float
    plan: float
    launch: float
    t_finalize: float
    finalize: float
    commit_wait: float
    commit: float
    t_committed: float
    idle_waits: int  # the loop's sleep counter at this commit

    @property
    def bookkeeping(self) -> float:
        return self.plan + self.launch + self.commit + self.finalize

    def spans(self) -> list[HostSpan]:
        t_launch = self.t_plan + self.plan
        t_commit = self.t_committed - self.commit
        return [HostSpan("plan", self.step_id, self.t_plan, t_launch),
                HostSpan("launch", self.step_id, t_launch, t_launch + self.launch),
                HostSpan("finalize", self.step_id, self.t_finalize, self.t_finalize + self.finalize),
                HostSpan("commit_wait", self.step_id, t_commit - self.commit_wait, t_commit),
                HostSpan("commit", self.step_id, t_commit, self.t_committed)]


@dataclass
class StepTrace:
    step_id: int
    kind: str
    num_seqs: int
    num_tokens: int
    start: float
    period: float
    forward: float
    sampling: float
    busy: float
    idle: float
    bookkeeping: float
    contiguous: bool  # the engine did not go idle before the next step
    host: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # plan, launch, commit, finalize
    commit_wait: float = 0.0  # host time spent awaiting this step's device→host copy

    @property
    def host_active(self) -> float:
        """The host's own time in the window: everything but waiting for the device (loop overhead included)."""
        return max(self.period - self.commit_wait, 0.0)


def covered(spans, lo: float, hi: float) -> float:
    """Length of [lo, hi) covered by the union of (start, end) intervals."""
    total, reach = 0.0, lo
    for s, e in sorted((max(s, lo), min(e, hi)) for s, e in spans):
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def derive(host: HostStep, spans: list[DeviceSpan], neighbours: list[DeviceSpan], next_start: float,
           contiguous: bool) -> StepTrace:
    """One step's record. `spans` are its own; `neighbours` those of steps k−1 and k+1."""
    fwd = next(s for s in spans if s.label == "forward")
    sampling = sum(s.end - s.start for s in spans if s.label != "forward")
    busy = covered([(s.start, s.end) for s in spans + neighbours], fwd.start, next_start)
    period = next_start - fwd.start
    return StepTrace(host.step_id, host.kind, host.num_seqs, host.num_tokens, fwd.start, period,
                     fwd.end - fwd.start, sampling, busy, period - busy, host.bookkeeping, contiguous,
                     (host.plan, host.launch, host.commit, host.finalize), host.commit_wait)


class Tracer:
    def __init__(self, max_steps: int = 20_000):
        self.host: dict[int, HostStep] = {}
        self.steps: deque[StepTrace] = deque(maxlen=max_steps)
        self.spans: deque[DeviceSpan] = deque(maxlen=8 * max_steps)
        self.listeners: list[Callable[[StepTrace], None]] = []  # e.g. metrics
        self._by_step: dict[int, list[DeviceSpan]] = {}  # recent steps only, for derivation
        self._max_steps = max_steps
        self._current = -1  # the step whose work is being launched
        self._loop: Any = None  # the EngineLoop it is attached to
        self._streams: tuple = ()

    # --- wiring ---------------------------------------------------------------------------------

    def attach(self, loop, runner, device) -> "Tracer":
        """Tag launches with their step, collect stream spans, and observe every commit."""
        self._loop = loop
        loop.observers.append(self.on_commit)
        forward, sampling = runner.launch_forward, runner.launch_sampling

        def launch_forward(step_id, packed, *a, **kw):
            self._current = step_id
            return forward(step_id, packed, *a, **kw)

        def launch_sampling(step, *a, **kw):
            self._current = step.step_id
            return sampling(step, *a, **kw)

        runner.launch_forward, runner.launch_sampling = launch_forward, launch_sampling
        self._streams = (device.compute, device.copy)
        for stream in self._streams:
            self._tag(stream)
        return self

    def detach(self) -> None:
        """The engine closed: keep the records, not the loop and the device's streams."""
        self._loop, self._streams = None, ()

    def _tag(self, stream) -> None:
        inner = stream.launch

        def launch(fn, label: str = ""):
            return inner(fn, (label, self._current) if label else "")

        stream.launch = launch  # instance attribute: only this engine's streams are traced
        stream.busy_hook = self.on_span

    def on_span(self, stream: str, tagged, start: float, end: float) -> None:
        """Called on the stream's thread after each labeled work item (list/dict ops are atomic)."""
        label, step = tagged
        span = DeviceSpan(stream, label, start, end, step)
        self.spans.append(span)
        self._by_step.setdefault(step, []).append(span)

    # --- per commit ---------------------------------------------------------------------------

    def on_commit(self, step) -> None:
        for stream in self._streams:  # CUDA streams report timed spans when polled, not as they finish
            stream.flush_spans()
        tm = step.timings
        k = step.step_id
        t_launch = tm.get("t_launch", 0.0)
        plan, launch = tm.get("plan", 0.0), tm.get("launch", 0.0)
        self.host[k] = HostStep(k, step.kind, len(step.seqs), step.packed.num_tokens,
                                getattr(getattr(step.launched, "slot", None), "index", 0), t_launch - launch - plan,
                                plan, launch,
                                tm.get("t_finalize", t_launch), tm.get("finalize", 0.0), tm.get("commit_wait", 0.0),
                                tm.get("commit", 0.0), tm.get("t_committed", 0.0), self._loop.idle_waits)
        # every span of steps ≤ k has been reported: each stream reports before its events fire
        prev = self.host.get(k - 1)
        if prev is not None and k - 1 in self._by_step and k in self._by_step:
            self._derive(prev, contiguous=self.host[k].idle_waits == prev.idle_waits)
        self.host.pop(k - self._max_steps, None)
        self._by_step.pop(k - 3, None)

    def _derive(self, host: HostStep, contiguous: bool) -> None:
        k = host.step_id
        mine, nxt = self._by_step[k], self._by_step[k + 1]
        starts = [s.start for s in nxt if s.label == "forward"]
        if not starts or not any(s.label == "forward" for s in mine):
            return
        rec = derive(host, list(mine), self._by_step.get(k - 1, []) + list(nxt), starts[0], contiguous)
        self.steps.append(rec)
        for fn in self.listeners:
            fn(rec)

    # --- queries --------------------------------------------------------------------------------

    def clear(self) -> None:
        self.host.clear()
        self.steps.clear()
        self.spans.clear()
        self._by_step.clear()

    def host_spans(self, first: int, last: int) -> list[HostSpan]:
        return [sp for k in range(first, last + 1) if k in self.host for sp in self.host[k].spans()]

    def device_spans(self, first: int, last: int) -> list[DeviceSpan]:
        return [s for s in list(self.spans) if first <= s.step <= last]

"""Launched-but-uncommitted steps and the zombie rules, as pure state (tested without a device).

Invariants, enforced here:
  * launch: every sequence in the step gets inflight_refs += 1 (never above the depth).
  * commit of a step happens in launch order, exactly once.
  * commit: inflight_refs -= 1 for every sequence of the step. A sequence already finalized when
    its step commits is a zombie: the commit is skipped for it (no token appended, no state change).
  * a finalized (or preempted) sequence's pages and row are released exactly once, at the first
    moment its inflight_refs is 0: at finalize time if nothing is in flight, otherwise by the
    commit that drops the last reference.
  * a failed step is abandoned instead of committed (in launch order too): its sequences have
    all been failed first, so dropping its references releases them like zombies.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from slipstream.errors import PipelineInvariantError
from slipstream.runtime.batch import PackedStep, SeqWork
from slipstream.scheduler.planner import Planner
from slipstream.scheduler.sequence import Sequence, SeqStatus


@dataclass
class InflightStep:
    step_id: int
    works: list[SeqWork]
    seqs: list[Sequence]
    packed: PackedStep
    kind: str
    slot: Any = None  # the runtime's DecodeSlot (opaque here)
    late_rows: list[int] = field(default_factory=list)  # sampling rows whose mask needs commit t-1
    timings: dict[str, float] = field(default_factory=dict)


class Pipeline:
    def __init__(self, depth: int, planner: Planner):
        self.depth = depth
        self.planner = planner
        self.inflight: deque[InflightStep] = deque()
        self.zombie_commits = 0  # rows whose commit was skipped because the sequence had finished
        self.released = 0
        self.finish_observers: list = []  # fn(seq, reason) once per finished sequence (metrics)

    def on_launch(self, step: InflightStep) -> None:
        if len(self.inflight) >= self.depth:
            raise PipelineInvariantError(f"launch with {len(self.inflight)} steps in flight at depth {self.depth}")
        for seq, work in zip(step.seqs, step.works):
            if seq.inflight_refs >= self.depth:
                raise PipelineInvariantError(f"{seq.request_id}: inflight_refs would exceed depth {self.depth}")
            seq.inflight_refs += 1
            seq.num_scheduled += work.num_tokens
            seq.pending_samples += work.sample
            seq.carry_on_device |= work.sample
        self.inflight.append(step)

    def oldest(self) -> InflightStep:
        return self.inflight[0]

    def on_commit(self, step: InflightStep, sampled: list[int], logprobs: list[float],
                  accept: Callable[[Sequence, int, float], None]) -> None:
        """Apply a step's sampled tokens. `accept(seq, token, logprob)` appends and runs stop checks."""
        if not self.inflight or self.inflight[0] is not step:
            raise PipelineInvariantError(f"step {step.step_id} committed out of launch order")
        self.inflight.popleft()
        tokens, lps = iter(sampled), iter(logprobs)
        for seq, work in zip(step.seqs, step.works):
            seq.inflight_refs -= 1
            token, logprob = (next(tokens), next(lps)) if work.sample else (None, 0.0)
            seq.pending_samples -= work.sample
            if seq.finalized:
                self.zombie_commits += work.sample
            elif token is not None:
                accept(seq, token, logprob)
            if not seq.finalized:  # a zombie's skipped token leaves its counts behind, by design
                seq.check()
            self.maybe_release(seq)
        if next(tokens, None) is not None:
            raise PipelineInvariantError(f"step {step.step_id}: more sampled tokens than sampling rows")

    def on_abandon(self, step: InflightStep) -> None:
        """Drop a failed step without tokens; every sequence in it must already be finalized."""
        if not self.inflight or self.inflight[0] is not step:
            raise PipelineInvariantError(f"step {step.step_id} abandoned out of launch order")
        self.inflight.popleft()
        for seq, work in zip(step.seqs, step.works):
            if not seq.finalized:
                raise PipelineInvariantError(f"{seq.request_id}: its step {step.step_id} was abandoned "
                                             "but the request was not failed")
            seq.inflight_refs -= 1
            seq.pending_samples -= work.sample
            self.maybe_release(seq)

    def finish(self, seq: Sequence, reason: str) -> bool:
        """Mark a sequence finished (first reason wins). Returns False if it already was."""
        if seq.finalized:
            return False
        seq.finalized, seq.finish_reason = True, reason
        for observe in self.finish_observers:
            observe(seq, reason)
        if seq.status is SeqStatus.WAITING:
            self.planner.drop_waiting(seq)
        else:
            self.maybe_release(seq)
        return True

    def maybe_release(self, seq: Sequence) -> None:
        if seq.inflight_refs == 0 and seq.row is not None and (seq.finalized or seq.preempting):
            self.planner.release(seq)
            self.released += 1

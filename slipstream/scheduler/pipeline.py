"""Launched-but-uncommitted steps and the zombie rules, as pure state (tested without a device).

Invariants, enforced here:
  * launch: every sequence in the step gets inflight_refs += 1 (never above the depth).
  * commit of a step happens in launch order, exactly once.
  * commit: inflight_refs -= 1 for every sequence of the step. A sequence already finished when
    its step commits is a zombie: the commit is skipped for it (no token appended, no state change).
  * a finished (or preempted) sequence's pages and row are released exactly once, at the first
    moment its inflight_refs is 0: at finish time if nothing is in flight, otherwise by the
    commit that drops the last reference.
  * commit: a live (non-zombie) sequence's `num_computed` grows by the tokens whose K/V the step
    wrote, and only then may its pages that this completed enter the prefix cache (never a page
    an in-flight step still writes, never a zombie's tokens): `PrefixCache.register`.
  * a failed step is abandoned instead of committed (in launch order too): its sequences have
    all been failed first, so dropping its references releases them like zombies.
"""
from __future__ import annotations

import os
from collections import deque
from typing import Callable

from slipstream.errors import PipelineInvariantError
from slipstream.runtime.runner_api import SampledTokens
from slipstream.scheduler.planner import Planner
from slipstream.scheduler.sequence import Sequence, SeqStatus
from slipstream.scheduler.step import Step

# accept(live sequences, their tokens, logprobs or None, top_logprobs alternatives or None): the output
# sink's tick side (OutputSink.accept), one call per commit
Accept = Callable[[list[Sequence], list[int], "list[float] | None", "list[dict[int, float] | None] | None"], None]


class Pipeline:
    def __init__(self, depth: int, planner: Planner):
        self.depth = depth
        self.planner = planner
        self.inflight: deque[Step] = deque()
        self.cache = planner.prefix_cache
        self.zombie_commits = 0  # rows whose commit was skipped because the sequence had finished
        self.released = 0
        self.finish_observers: list = []  # fn(seq, reason) once per finished sequence (metrics)
        # Sequence.check() on every decode row at every commit (tests set SLIPSTREAM_CHECK_INVARIANTS=1);
        # chunk rows are always checked
        self.check_every_row = os.environ.get("SLIPSTREAM_CHECK_INVARIANTS") == "1"

    def on_launch(self, step: Step) -> None:
        if len(self.inflight) >= self.depth:
            raise PipelineInvariantError(f"launch with {len(self.inflight)} steps in flight at depth {self.depth}")
        depth = self.depth
        for seq in step.decode:  # the hot loop: a few integer updates per row
            if seq.inflight_refs >= depth:
                raise PipelineInvariantError(f"{seq.request_id}: inflight_refs would exceed depth {depth}")
            seq.inflight_refs += 1
            seq.num_scheduled += 1
            seq.pending_samples += 1
        for seq, work in zip(step.chunk_seqs, step.chunks):
            if seq.inflight_refs >= depth:
                raise PipelineInvariantError(f"{seq.request_id}: inflight_refs would exceed depth {depth}")
            seq.inflight_refs += 1
            seq.num_scheduled += work.num_tokens
            seq.pending_samples += work.sample
            seq.last_token_on_device |= work.sample
        if step.drafts is not None:  # as if every draft were accepted (speculation.py)
            for seq, k in zip(step.decode, step.drafts):
                seq.num_scheduled += k
                seq.pending_samples += k
                seq.drafts_in_flight += k
        self.inflight.append(step)

    def oldest(self) -> Step:
        return self.inflight[0]

    def on_commit(self, step: Step, result: SampledTokens, accept: Accept) -> None:
        """Apply a step's sampled tokens (`result`, in sampling-row order: decode rows, then sampling
        chunks): the counts of every row first, then one `accept(seqs, tokens, logprobs, tops)` for
        the live rows (it appends and runs the tick's stop checks, which may finish some), then the
        releases. `result.top` holds the top_logprobs alternatives of the rows that asked for them;
        `result.carried` the (kind, values) of the rows that sampled a carry token, kept as
        `Sequence.carried` of the token's output index (not for a zombie)."""
        if not self.inflight or self.inflight[0] is not step:
            raise PipelineInvariantError(f"step {step.step_id} committed out of launch order")
        self.inflight.popleft()
        if step.drafts is not None:
            self._commit_runs(step, result, accept)
            return
        sampled, logprobs, top, carried = result[:4]
        decode = step.decode
        d = len(decode)
        n_chunk_samples = sum(w.sample for w in step.chunks) if step.chunks else 0
        if len(sampled) != d + n_chunk_samples:
            raise PipelineInvariantError(f"step {step.step_id}: {len(sampled)} sampled tokens for "
                                         f"{d + n_chunk_samples} sampling rows")
        cache, full = self.cache, self.planner.page_size
        keep = None
        if carried:  # before the loops: whether the row is a zombie is decided by its state now
            by_row = step.sampling_seqs()
            keep = [(by_row[i], value) for i, value in carried.items() if not by_row[i].finished]
        live: list[Sequence] = []
        at: list[int] | None = None  # sampling rows of `live`, once a row is left out
        later: list[Sequence] = []  # rows to release once the commit is applied (zombies, victims)
        for i, seq in enumerate(decode):  # the hot loop: integer updates
            seq.inflight_refs -= 1
            seq.pending_samples -= 1
            if seq.finished:
                self.zombie_commits += 1
                later.append(seq)
                if at is None:
                    at = list(range(len(live)))
                continue
            seq.num_computed += 1  # the K/V of its input token (the previous sample) is written
            if cache is not None and seq.num_computed - seq.prefix.num_registered_pages * full >= full:
                if seq.prefix.cache_extra is not None:
                    cache.register(seq)
            live.append(seq)
            if at is not None:
                at.append(i)
            if seq.preempting:
                later.append(seq)
        spec = self.planner.speculation
        if spec is not None and spec.shadow is not None and d and spec.on_plain_commit(decode, sampled):
            self.planner.batch_changed()  # (a shadow probe says a row's drafts pay: plan it again)
        if step.chunks:
            at = self._commit_chunks(step, live, list(range(len(live))) if at is None else at, d)
        elif result.step_ms is not None and d and spec is not None:
            spec.on_step_cost(d, d, 0, result.step_ms)
        if live:
            if at is None:  # every row lives: the tokens as they came
                accept(live, sampled, logprobs, [top.get(i) for i in range(len(live))] if top else None)
            else:
                accept(live, [sampled[i] for i in at], None if logprobs is None else [logprobs[i] for i in at],
                       [top.get(i) for i in at] if top else None)
        if self.check_every_row:
            for seq in live:
                if not seq.finished:
                    seq.check()
        for seq in step.chunk_seqs:
            if not seq.finished:  # a zombie's skipped token leaves its counts behind, by design
                seq.check()
            self.maybe_release(seq)
        for seq in later:
            self.maybe_release(seq)
        if keep:  # each row committed one token this step: its newest
            for seq, value in keep:
                seq.carried[len(seq.output_ids) - 1] = value

    def _commit_runs(self, step: Step, result: SampledTokens, accept: Accept) -> None:
        """A speculating step (no chunks): each decode row emitted a run of 1..k+1 tokens. The counts
        planned for k + 1 are corrected by what was emitted; the runs are applied one token per row
        per `accept`, so a row that a token finishes takes none of the rest of its run."""
        runs = result.runs
        if runs is None or len(runs) != len(step.decode):
            raise PipelineInvariantError(f"step {step.step_id}: {0 if runs is None else len(runs)} runs for "
                                         f"{len(step.decode)} speculating rows")
        spec = self.planner.speculation
        fed = result.fed or step.drafts or ()
        if spec is not None and result.draft_cost is not None:
            spec.on_draft_cost(result.draft_cost, len(step.decode), len(step.decode) + sum(fed))
        if spec is not None and result.step_ms is not None:
            spec.on_step_cost(len(step.decode), len(step.decode) + sum(fed), sum(k > 0 for k in step.drafts or ()),
                              result.step_ms)
        live: list[tuple[Sequence, list[int]]] = []
        later: list[Sequence] = []
        for seq, k, run, f in zip(step.decode, step.drafts or (), runs, fed):
            seq.inflight_refs -= 1
            seq.pending_samples -= k + 1
            seq.drafts_in_flight -= k
            if seq.finished:
                self.zombie_commits += 1
                later.append(seq)
                continue
            if not 1 <= len(run) <= f + 1 <= k + 1:
                raise PipelineInvariantError(f"{seq.request_id}: a run of {len(run)} tokens from {k} drafts")
            if len(run) <= k and seq.max_tokens - len(seq.output_ids) - seq.pending_samples <= k + 1:
                # it had no sample left as planned (this step's k + 1 counted), so the plans since left
                # it out, a steady batch too: the rejected drafts give samples back and it decodes again
                self.planner.batch_changed()
            seq.num_scheduled -= k + 1 - len(run)  # the rejected drafts' positions are scheduled again
            seq.num_computed += len(run)  # its input and the accepted drafts: their K/V is final
            if spec is not None and k:
                spec.on_commit(seq, f, len(run))
            live.append((seq, run))
            if seq.preempting:
                later.append(seq)
        j = 0
        while live:
            accept([seq for seq, _ in live], [run[j] for _, run in live], None, None)
            j += 1
            live = [(seq, run) for seq, run in live if len(run) > j and not seq.finished]
        cache, full = self.cache, self.planner.page_size
        for seq in step.decode:
            if seq.finished:
                continue
            # (after the runs are appended: a page's block hash reads its tokens)
            prefix = seq.prefix
            if cache is not None and prefix.cache_extra is not None and seq.num_computed - prefix.num_registered_pages * full >= full:
                cache.register(seq)
            if self.check_every_row:
                seq.check()
        for seq in later:
            self.maybe_release(seq)

    def _commit_chunks(self, step: Step, live: list[Sequence], at: list[int], d: int) -> list[int]:
        """The chunks' counts; their live sampling rows join `live` (and their indices `at`)."""
        cache, k = self.cache, d
        for seq, work in zip(step.chunk_seqs, step.chunks):
            seq.inflight_refs -= 1
            if not seq.finished:
                seq.num_computed += work.num_tokens
                if cache is not None and seq.prefix.cache_extra is not None:
                    cache.register(seq)
            if work.sample:
                seq.pending_samples -= 1
                if seq.finished:
                    self.zombie_commits += 1
                else:
                    live.append(seq)
                    at.append(k)
                k += 1
        return at

    def on_abandon(self, step: Step) -> None:
        """Drop a failed step without tokens; every sequence in it must already be finished."""
        if not self.inflight or self.inflight[0] is not step:
            raise PipelineInvariantError(f"step {step.step_id} abandoned out of launch order")
        self.inflight.popleft()
        drafts = (step.drafts or [0] * len(step.decode)) + [0] * len(step.chunks)
        samples = [1 + k for k in drafts[:len(step.decode)]] + [int(w.sample) for w in step.chunks]
        for seq, sample, k in zip(step.seqs, samples, drafts):
            if not seq.finished:
                raise PipelineInvariantError(f"{seq.request_id}: its step {step.step_id} was abandoned "
                                             "but the request was not failed")
            seq.inflight_refs -= 1
            seq.pending_samples -= sample
            seq.drafts_in_flight -= k
            self.maybe_release(seq)

    def finish(self, seq: Sequence, reason: str) -> bool:
        """Mark a sequence finished (first reason wins). Returns False if it already was."""
        if seq.finished:
            return False
        seq.finished, seq.finish_reason = True, reason
        self.planner.batch_changed()
        for observe in self.finish_observers:
            observe(seq, reason)
        if seq.status is SeqStatus.WAITING:
            self.planner.drop_waiting(seq)
        else:
            self.maybe_release(seq)
        return True

    def maybe_release(self, seq: Sequence) -> None:
        if seq.inflight_refs == 0 and seq.row is not None and (seq.finished or seq.preempting):
            self.planner.release(seq)
            self.released += 1

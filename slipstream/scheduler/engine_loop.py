"""The tick: plan → launch → commit → finalize, on one asyncio loop, at depth 1 or 2.

  plan      choose the next batch (Planner) — only sequences with < depth steps in flight
  launch    enqueue its forward into a free StepSlot (behind the encodes of images it feeds
            first); decode inputs are read on the device
  commit    await the oldest finalized step's copy event, apply its tokens (zombies skipped),
            end what token ids decide, release slots and pages; text, stop strings and stream
            deltas are the output sink's stage, beside the tick (OutputSink.run_stage)
  finalize  enqueue sampling of the rows whose grammar mask depends on the token committed at t
            (mask built from committed state, uploaded on the copy stream), then the step's
            device→host copy. Rows that need nothing from the host (unconstrained ones) were
            sampled right behind the forward at launch, so they never wait for a commit: forward
            now, sample later, only where a mask makes it necessary.

With depth 1 a step is committed before the next is planned (the blocking baseline); with depth 2
the forward of t+1 is launched before step t is committed — while t still runs. A step already
done when a tick starts is committed first at either depth (nothing on the device to keep busy;
its tokens need not wait out the next launch). Nothing else differs.

Failures (docs/reliability.md):
  * work launched for a step raised on a stream (forward, sampling, copy): its commit raises;
    every request of every step in flight fails with StepFailedError (the step behind it read
    the failed step's outputs or was skipped by the failed stream), the device drains and its
    streams recover, and the loop goes on with everyone else. Never a stale buffer: the copy
    carries the error, and the slot's stamp proves sampling ran for this step.
  * one request's processing raised in commit (detokeniser, matcher, stop check): only that
    request fails.
  * a launched step not done after step_timeout_s: the watchdog logs the state and the engine
    fails (StepTimeoutError for its requests, EngineClosedError for the rest).
  * anything else is a bug: the loop dies and every waiter gets EngineClosedError.
The runner is a `Runner` (slipstream/runtime/runner_api.py: ForwardInput in, SampledTokens out),
so this file never touches torch or a device API.
"""
from __future__ import annotations

import asyncio
import time

import numpy as np

import structlog

from slipstream.errors import EngineClosedError, PipelineInvariantError, StepFailedError, StepTimeoutError
from slipstream.runtime.batch import ForwardInput, pack_step
from slipstream.runtime.runner_api import Runner
from slipstream.scheduler.constraints import Constraints
from slipstream.scheduler.output_sink import OutputSink
from slipstream.scheduler.pipeline import Pipeline
from slipstream.scheduler.planner import Planner
from slipstream.scheduler.sequence import Sequence
from slipstream.scheduler.step import Step
from slipstream.scheduler.watchdog import Watchdog

log = structlog.get_logger(__name__)


class EngineLoop:
    def __init__(self, runner: Runner, planner: Planner, outputs: OutputSink, depth: int, page_size: int,
                 row_multiple: int = 1, vocab_width: int = 0, eos_ids: tuple[int, ...] = (),
                 step_timeout_s: float = 300.0):
        self.runner, self.planner, self.depth = runner, planner, depth
        self.page_size, self.row_multiple = page_size, row_multiple
        self.pipeline = Pipeline(depth, planner)
        self.outputs = outputs
        outputs.bind(self.finish)
        self.constraints = Constraints(vocab_width, eos_ids, self.outputs.fail)
        self.pipeline.finish_observers.append(self.constraints.on_finish)
        self.num_steps = 0
        self.observers: list = []  # fn(step) after each commit: tracing, metrics (empty: no cost)
        self.idle_waits = 0  # times the loop slept for work: a step period never spans one
        self._wake = asyncio.Event()
        self._closing = False
        self._ended = False  # run() returned or raised: a request submitted now is failed at once
        self.error: BaseException | None = None
        self.step_timeout_s = step_timeout_s
        self.failed_steps = 0  # steps whose launched work raised (their requests failed)
        # the steady batch's decode list (the Planner hands the same list out) and its packed input
        self._steady_rows: list[Sequence] | None = None
        self._steady_input: ForwardInput | None = None

    # --- requests -----------------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        self.constraints.on_submit(seq)
        self.planner.add(seq)
        if self._ended:  # (a caller that checked before awaiting its tokenizer or grammar) nothing would serve it
            self.outputs.fail(seq, self.error or EngineClosedError("engine loop stopped"))
            return
        self._wake.set()

    def abort(self, seq: Sequence) -> None:
        self.outputs.abort(seq)
        self._wake.set()

    def close(self) -> None:
        self._closing = True
        self._wake.set()

    def finish(self, seq: Sequence, reason: str) -> bool:
        """End a sequence (the sink's callback: the tick, an abort, or the output stage, which may end
        a request while the loop sleeps — so it wakes the loop to reuse the row and pages)."""
        if not self.pipeline.finish(seq, reason):
            return False
        self._wake.set()
        return True

    # --- the loop -------------------------------------------------------------------------------

    async def run(self) -> None:
        watchdog = asyncio.create_task(Watchdog(self, self.step_timeout_s).run(asyncio.current_task()),
                                       name="slipstream-watchdog")
        stage = asyncio.create_task(self.outputs.run_stage(), name="slipstream-output-stage")
        try:
            await self._run()
        except BaseException as e:
            self.fail_all(self.error or e)
            raise
        finally:
            self._ended = True
            if self.error is None:  # closed: one submitted while it drained is not left waiting
                self._fail_unfinished(EngineClosedError("engine loop stopped"))
            watchdog.cancel()
            stage.cancel()
            self.outputs.process_pending()  # what the stage had not reached: nothing is left undelivered

    async def _run(self) -> None:
        while not self._closing:
            if not self.pipeline.inflight and not self.planner.has_work():
                self._steady_rows = self._steady_input = None  # (idle: no finished sequence kept alive)
                self._wake.clear()
                self.idle_waits += 1
                await self._wake.wait()
                continue
            if not await self.tick():
                # nothing launchable and nothing in flight: only a new request or an abort can
                # change that, and both set the wake event
                self._wake.clear()
                self.idle_waits += 1
                await self._wake.wait()
                continue
            # A commit whose step is already done does not suspend: a host-bound loop (the device
            # ahead of it) would otherwise never let the output stage, stream consumers or new
            # requests run until it idled — first tokens delivered at the end of a generation.
            await asyncio.sleep(0)
        # drain: never leave a step uncommitted (its slot and pages would leak)
        while self.pipeline.inflight:
            await self.commit(self.pipeline.oldest())

    async def tick(self) -> bool:
        launched = None
        inflight = self.pipeline.inflight
        # Commit first when the oldest step's tokens are on the host already: the device has no
        # work behind it to keep busy, and its first tokens would otherwise wait out the next
        # launch (an eager prefill launch costs the host tens of ms on CUDA). Period unchanged:
        # a host-bound loop does the same commit + launch per step in either order.
        committed = bool(inflight) and self.runner.is_done(inflight[0].launched)
        if committed:
            await self.commit(inflight[0])
        t0 = time.perf_counter()
        plan = self.planner.plan(self.depth) if len(inflight) < self.depth else None
        t1 = time.perf_counter()
        if plan is not None:
            launched = self.launch(plan)
            launched.timings.update(plan=t1 - t0, launch=time.perf_counter() - t1)
        oldest = inflight[0] if inflight else None
        if not committed and oldest is not None and oldest is not launched:
            committed = True
            await self.commit(oldest)
        if launched is not None and launched in self.pipeline.inflight:  # (not abandoned by a failure)
            self.finalize(launched)
        return launched is not None or committed

    def launch(self, step: Step) -> Step:
        packed = self._pack(step)
        step_id = self.num_steps
        self.num_steps += 1
        if step.encodes or step.drops:
            self._launch_images(step)
        # some live request has a grammar: which rows need a mask, when (a speculating step has no
        # constrained row: speculation.py)
        masked = self.constraints.live and step.drafts is None
        step.step_id, step.packed = step_id, packed
        step.launched = self.runner.launch_forward(step_id, packed, unmasked=not masked)
        self.pipeline.on_launch(step)
        if masked:
            sampling = step.sampling_seqs()
            early, step.late_rows = self.constraints.split(sampling)
            if early or not step.late_rows:
                mask = self.constraints.masks(sampling, early)
                self.runner.launch_sampling(step.launched, early, mask, final=not step.late_rows)
        step.timings["t_launch"] = time.perf_counter()
        return step

    def _launch_images(self, step: Step) -> None:
        """Images this step feeds first are encoded right before its forward, on the same stream;
        outputs the encoder cache evicted are dropped first (no launched step reads them)."""
        if step.drops:
            self.runner.drop_features(step.drops)
        if step.encodes:
            self.runner.launch_encoder(step.encodes)

    def _pack(self, step: Step) -> ForwardInput:
        """The runner-side input of a planned step (the one place the loop builds it). The Planner's
        steady batch hands out the same decode list again: its input is the same ForwardInput, or
        that input with the step's page-table entries."""
        if step.decode is self._steady_rows and not step.chunks:
            steady = self._steady_input
            assert steady is not None
            if not step.page_writes:
                return steady
            return steady.with_page_writes(np.asarray(step.page_writes, np.int64).reshape(-1, 3))
        rows = np.fromiter((seq.row for seq in step.decode), np.int64, len(step.decode))
        packed = pack_step(rows, step.chunks, np.asarray(step.page_writes, np.int64).reshape(-1, 3),
                           self.row_multiple, step.drafts)
        if not step.chunks and not step.page_writes and step.drafts is None:
            self._steady_rows, self._steady_input = step.decode, packed
        return packed

    async def commit(self, step: Step) -> None:
        t0 = time.perf_counter()
        try:
            result = await self.runner.read_sampled(step.launched)
        except PipelineInvariantError:
            raise
        except Exception as e:  # noqa: BLE001 - launched work of this step raised on some stream
            await self._recover(step, e)
            return
        t1 = time.perf_counter()
        self.outputs.commit_time = t1  # one clock read per step: the commit time of all its tokens
        self.pipeline.on_commit(step, result, self.outputs.accept)
        t2 = time.perf_counter()
        step.timings.update(commit_wait=t1 - t0, commit=t2 - t1, t_committed=t2)
        for observe in self.observers:
            observe(step)

    def finalize(self, step: Step) -> None:
        t0 = time.perf_counter()
        step.timings["t_finalize"] = t0
        if step.late_rows:  # every step before this one is committed: matchers are current
            mask = self.constraints.masks(step.sampling_seqs(), step.late_rows)
            self.runner.launch_sampling(step.launched, step.late_rows, mask, final=True)
        step.timings["finalize"] = time.perf_counter() - t0

    # --- failure ----------------------------------------------------------------------------

    async def _recover(self, failed: Step, error: BaseException) -> None:
        """`failed` (the oldest step) raised: fail the requests of every step in flight, drain, recover."""
        steps = list(self.pipeline.inflight)
        self.failed_steps += len(steps)
        log.error("step_failed", effect="its requests fail, the engine goes on", step=failed.step_id, kind=failed.kind,
                  sequences=len(failed.seqs), steps_in_flight=len(steps), error=repr(error))
        for step in steps:
            for seq in step.seqs:
                e = StepFailedError(f"step {failed.step_id} ({failed.kind}) failed on the device: {error!r}")
                e.__cause__ = error
                self.outputs.fail(seq, e)
        await self.runner.drain()
        recovered = self.runner.recover([step.launched for step in steps])
        # page-table entries of requests these steps did not carry (admitted without a chunk): again
        self.planner.pages.requeue([w for step in steps for w in step.page_writes], self.planner.running)
        self.planner.batch_changed()
        for step in steps:
            for span in step.encodes:  # a failed stream may have skipped them: encode again when needed
                self.planner.encoder_cache.unlaunch(span.digest)
            self.pipeline.on_abandon(step)
        if not recovered:
            raise EngineClosedError(f"the device could not recover from a failed step: {error!r}") from error

    def on_stall(self, step: Step, waited_s: float) -> None:
        """The watchdog saw `step` in flight for too long: log the state and fail the engine."""
        log.error("step_timed_out", effect="the engine stops", step=step.step_id, kind=step.kind,
                  waited_s=round(waited_s, 3), timeout_s=self.step_timeout_s, **self.describe_state())
        timeout = StepTimeoutError(f"step {step.step_id} ({step.kind}) did not complete within "
                                   f"{self.step_timeout_s:g} s (waited {waited_s:.3g} s)")
        for seq in step.seqs:
            self.outputs.fail(seq, StepTimeoutError(*timeout.args))
        self.error = EngineClosedError(f"engine stopped: {timeout}")
        self.error.__cause__ = timeout

    def describe_state(self) -> dict:
        now = time.perf_counter()
        return {
            "slots": [f"{s.index}:" + (f"step={s.owner.step_id}" if s.owner else "free")
                      for s in getattr(self.runner, "slots", ())],
            "inflight_steps": [f"{s.step_id}:{s.kind}:{len(s.seqs)} seqs"
                               f":age={now - s.timings.get('t_launch', now):.3f}s"
                               for s in self.pipeline.inflight],
            "sequences": [f"{q.request_id}:finished={q.finished}:inflight_refs={q.inflight_refs}"
                          f":pending_samples={q.pending_samples}" for q in self.planner.running[:64]],
            "waiting": self.planner.num_waiting,
        }

    def fail_all(self, error: BaseException) -> None:
        """The loop died: every unfinished request gets the error instead of hanging."""
        if not isinstance(error, Exception):
            error = EngineClosedError(f"engine loop stopped: {error!r}")
        elif not isinstance(error, EngineClosedError):
            closed = EngineClosedError(f"engine loop died: {error!r}")
            closed.__cause__ = error
            error = closed
        self.error = error
        self._fail_unfinished(error)

    def _fail_unfinished(self, error: BaseException) -> None:
        seqs = list(self.planner.waiting) + list(self.planner.running)
        seqs += [seq for step in self.pipeline.inflight for seq in step.seqs]
        for seq in dict.fromkeys(seqs):
            if not seq.finished and seq.user is not None:
                self.outputs.fail(seq, error)

"""Runs steps on a device: forward on the compute stream, sampling after it, the copy back.

The runner knows nothing about requests. It owns the model, the KV cache, the StepSlots and the
persistent batch (runtime/step/row_tables.py: each row's newest token, next position, page-table row
and sampling parameters). A step arrives as a `ForwardInput` (runtime/batch.py); `launch_forward`
takes the next free slot in turn, stages the input in the slot's StepArena unless the slot holds it
already (a steady batch relaunches the same input: only new page-table entries are staged), and
returns its `LaunchedStep` (runtime/step/step_slot.py). Its path, chosen once per staged input
(runtime/graphs/graph_choice.py): a decode, greedy decode (which samples too) or carry decode graph
of its slot and bucket, a mixed graph by token bucket (runtime/graphs/static_step.py's layout), or
eagerly (`StepForward`, runtime/step/row_tables.py: what the graphs capture too). An unmasked step is
sampled right behind its forward (runtime/sampling/sampling_launch.py); a masked step's groups come
through `launch_sampling`. Then the copy to the slot's host buffers (the copy stream; on a
unified-memory device the compute stream). A speculating step goes to speculation/runner.py.

Invariants, enforced by the scheduler and checked in tests (tests/fake_runner.py mirrors them):
  * stream order (a step's table writes precede the next step's reads on the compute stream) keeps
    every read current at depth 1 and 2;
  * row 0 is never held by a sequence: padding tokens use it, its page row stays all zeros (the
    scratch page), its position is reset to 0 by every step that has padding;
  * a row is handed to a new sequence only when no launched step references it, and the new
    sequence's first chunk rewrites its position, parameters and output index.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from slipstream.errors import PipelineInvariantError
from slipstream.intmath import round_up
from slipstream.models.carry_kind import CarryKind
from slipstream.models.base import KVCache, Model
from slipstream.runtime.batch import ForwardInput
from slipstream.runtime.step.carry import read_carried
from slipstream.runtime.step.encoder_launch import ImageEncodes
from slipstream.runtime.step.row_tables import RowTables, StepForward
from slipstream.runtime.graphs.graph_choice import GraphChoice
from slipstream.runtime.step.step_slot import LaunchedStep, Staged, StepSlot, check_others_sampled, launch_copy
from slipstream.runtime.runner_api import SampledTokens
from slipstream.runtime.sampling.sampling_launch import SamplingLauncher
from slipstream.speculation.runner import SpecRunner
from slipstream.runtime.step.staging import StepArena

if TYPE_CHECKING:
    from slipstream.faults import FaultInjector



class ModelRunner(GraphChoice):
    """Implements slipstream.runtime.runner_api.Runner on a Device."""

    def __init__(self, model: Model, kv: KVCache, device, max_rows: int, max_tokens: int,
                 max_pages: int, num_slots: int = 2, row_multiple: int = 1):
        self.model, self.kv, self.device = model, kv, device
        self.row_multiple = row_multiple  # pad steps so CPU matmul rows do not depend on batch size
        self.rows = RowTables(max_rows, max_pages, model.config.vocab_size, device.torch_device)
        self.forward = StepForward(model, kv, self.rows)  # what eager steps run and graphs capture
        max_tokens = round_up(max(max_tokens, max_rows), row_multiple)
        self.slots = [StepSlot(i, device, max_rows, model.config.vocab_size,
                               StepArena(device, max_tokens, max_rows, max_pages)) for i in range(num_slots)]
        self.vocab_size = model.config.vocab_size
        self._turn = 0  # the slot the next step takes if it is free
        self.sampler = SamplingLauncher(device, self.rows, model)
        self._faults: FaultInjector | None = None
        self.images = ImageEncodes(model, device)  # vision encodes and the embeddings image steps take
        self.eager_steps = 0  # steps launched without a graph (stats(): on CUDA, 0 in steady serving)
        self.spec: SpecRunner | None = None  # speculating steps (speculation/runner.py; EngineConfig.speculative)
        # with speculation on, steps are timed on the compute stream (SampledTokens.step_ms): the cost
        # table cannot know the device (speculation/policy.py)
        self.spec_timed = False

    def set_lora(self, slot: int, weights, staged=None) -> None:
        """StepForward.set_lora, on the compute stream when the adapters live in a device bank: its copy
        lands after every step launched before and before every step launched after (docs/lora.md)."""
        if self.forward.lora_bank is None:
            self.forward.set_lora(slot, weights)
        else:
            self.device.compute.launch(lambda: self.forward.set_lora(slot, weights, staged))

    def launch_encoder(self, images) -> None:
        self.images.launch(images)

    def drop_features(self, digests) -> None:
        self.images.drop(digests)

    @property
    def carry_kinds(self) -> tuple[CarryKind, ...]:
        """The model's carry heads' kinds (kind k is [k - 1]); empty: it has none."""
        heads = self.model.carry_heads
        return tuple(heads.kinds) if heads is not None else ()

    @property
    def faults(self) -> FaultInjector | None:
        """Tests only: a slipstream.faults.FaultInjector (None: no cost)."""
        return self._faults

    @faults.setter
    def faults(self, injector: FaultInjector | None) -> None:
        self._faults = self.sampler.faults = injector

    def launch_forward(self, step_id: int, packed: ForwardInput, unmasked: bool = False) -> LaunchedStep:
        """Enqueue the forward of one step into a free slot; returns at once. `unmasked`: no row of
        the step carries a grammar mask, so every row is sampled right behind the forward and its
        tokens copied (no launch_sampling follows), and a decode step whose rows are all plain
        greedy may replay the graph that samples too. The same ForwardInput launched again (a
        steady batch) runs as staged in the slot last time it ran there: nothing is staged, chosen
        or uploaded."""
        if packed.num_drafts is not None:  # a speculating step: its own path (speculation/runner.py)
            assert self.spec is not None, "a step with drafts on a runner without speculation"
            return self.spec.launch(step_id, packed)
        slot = self.free_slot()
        staged = slot.staged
        if staged is None or staged.packed is not packed or staged.unmasked is not unmasked:
            if (staged is not None and staged.unmasked is unmasked and packed.decode_rows is staged.packed.decode_rows
                    and not packed.chunks):  # the same rows: only other page-table entries
                staged = slot.restage_writes(staged, packed)
            else:
                staged = slot.stage(packed, unmasked, self.rows.sampling, self._choose_graph)
        elif staged.updates is not None:
            raise PipelineInvariantError(f"step {step_id} relaunches an input that writes the row tables")
        step = LaunchedStep(step_id, slot, staged, staged.num_samples)
        slot.acquire(step)
        if self.spec_timed and unmasked:  # (a masked step's span would hold the host's mask wait)
            step.started = self.device.compute.mark()
        if staged.graphed is None:
            self.eager_steps += 1
            self._launch_eager(step)
        else:
            self._launch_graph(step)
        if unmasked:  # every row, right behind the forward; then the copy
            if staged.sampled_in_graph or staged.needs.plain_greedy:
                self._launch_greedy(step)
            else:
                self.sampler.launch(step)
            launch_copy(self.device, step)
        return step

    def free_slot(self) -> StepSlot:
        """The next slot in turn that is free (ping-pong: steps alternate slots when both are free)."""
        slots = self.slots
        n = len(slots)
        for k in range(n):
            slot = slots[(self._turn + k) % n]
            if slot.owner is None:
                self._turn = (slot.index + 1) % n
                return slot
        raise PipelineInvariantError("no free StepSlot although fewer than depth steps are in flight")

    def _launch_graph(self, step: LaunchedStep) -> None:
        slot, staged = step.slot, step.staged
        graphed = staged.graphed
        check_others_sampled(self.slots, step)
        graphed.cache.replays[slot.index, graphed.bucket] += 1
        rows, graph, samples, carry = self.rows, graphed.graph, graphed.samples, graphed.carry
        updates, packed, step_id = staged.updates, staged.packed, step.step_id
        before = self._known_before(packed)

        def forward() -> None:
            self.check_fault(step_id)
            if updates is not None:
                rows.apply(updates, packed)
            if before is not None:
                before()
            if carry:
                slot.carry_out.zero_()  # as eagerly: rows of groups without carry rows carry nothing
                step.logits, step.hidden = graph.replay()
                return
            out = graph.replay()
            step.logits = None if samples else out

        self.device.compute.launch(forward, "forward")

    def _launch_eager(self, step: LaunchedStep) -> None:
        staged, step_id = step.staged, step.step_id
        packed, tensors, updates, carry = staged.packed, staged.tensors, staged.updates, staged.chunk_carry
        rows, host_attention = self.rows, self.device.unified_memory
        before = self._known_before(packed)
        if carry is None and not packed.embed_sources and packed.bidirectional_lens is None:
            def forward() -> None:  # a text step: the common case
                self.check_fault(step_id)
                if updates is not None:
                    rows.apply(updates, packed)
                if before is not None:
                    before()
                step.logits = self.forward.logits(tensors, host_attention)

            self.device.compute.launch(forward, "forward")
            return
        slot, bidi = step.slot, packed.bidirectional_lens

        def forward_with() -> None:
            self.check_fault(step_id)
            if updates is not None:
                rows.apply(updates, packed)
            if before is not None:
                before()
            embeds = self.images.embeds(packed, tensors.decode_rows.shape[0]) if packed.embed_sources else None
            if carry is None:
                step.logits = self.forward.logits(tensors, host_attention, embeds, None, bidi)
                return
            slot.carry_out.zero_()  # rows sampled by a group without carry rows carry nothing
            step.logits, step.hidden = self.forward.logits(tensors, host_attention, embeds,
                                                         carry.to_device(rows.device), bidi)

        self.device.compute.launch(forward_with, "forward")

    def _known_before(self, packed: ForwardInput):
        """With speculation on, the history write a step's forward runs first (SpecRunner.known_before)."""
        return None if self.spec is None or not packed.chunks else self.spec.known_before(packed)

    def check_fault(self, step_id: int) -> None:
        if self._faults is not None:
            self._faults.check("forward", step_id)

    def launch_sampling(self, step: LaunchedStep, rows: list[int] | None = None,
                        bitmask: np.ndarray | None = None, final: bool = True) -> None:
        """Enqueue sampling of some of a masked step's rows (SamplingLauncher.launch documents the
        arguments); after the final group, its copy to the host."""
        if step.sampled:
            raise PipelineInvariantError(f"step {step.step_id}: sampling launched after its final group")
        self.sampler.launch(step, rows, bitmask, final)
        if final:
            launch_copy(self.device, step)

    def _launch_greedy(self, step: LaunchedStep) -> None:
        """A plain greedy step's sampling right behind its forward (RowTables.greedy; nothing when its
        greedy decode graph sampled it already), and its stamp."""
        rows, slot, step_id, n = self.rows, step.slot, step.step_id, step.num_samples
        greedy = not step.staged.sampled_in_graph and n > 0
        table_rows = step.staged.tensors.sample_rows
        if table_rows.shape[0] != n:  # a decode graph's bucket pads the rows (and its logits)
            table_rows = table_rows[:n]

        def sample() -> None:
            if self._faults is not None:
                self._faults.check("sample", step_id)
            if greedy:
                logits = step.logits
                assert logits is not None  # (written by the step's forward, earlier on this stream)
                rows.greedy(logits if logits.shape[0] == n else logits[:n], table_rows, slot.sampled)
            slot.stamp.fill_(step_id)  # proof that this step's sampling ran, in the same copy

        self.device.compute.launch(sample, "sample")

    # --- commit ---------------------------------------------------------------------------------

    def is_done(self, step: LaunchedStep) -> bool:
        done = step.copy_done
        return done is not None and done.query()

    async def read_sampled(self, step: LaunchedStep) -> SampledTokens:
        """Await the step's copy event without blocking the loop, then read tokens and logprobs and
        free its slot. Raises what launched work of the step (on any stream) raised."""
        done = step.copy_done
        if done is None:
            raise PipelineInvariantError(f"step {step.step_id} read before its final sampling launched")
        await done.wait_async()
        if self.spec is not None and step.staged.packed.num_drafts is not None:
            return self.spec.read(step)
        slot, n = step.slot, step.num_samples
        ids, logprobs = slot.read_host(step, n, step.logprobs)
        top = carried = None
        if step.top_k:  # rows that asked for top_logprobs: {token id: logprob}, most likely first
            want = self.rows.sampling.top_logprobs[step.sample_rows_host]
            values, top_ids = slot.host_top_values[:n].tolist(), slot.host_top_ids[:n].tolist()
            top = {i: dict(zip(top_ids[i][:k], values[i][:k])) for i, k in enumerate(want.tolist()) if k}
        if step.staged.carry:
            carried = read_carried(slot.host_carry[:n].numpy(), [k.values for k in self.carry_kinds])
        slot.release()  # the host buffer has been read: the slot may take a new step
        return SampledTokens(ids, logprobs, top, carried, step_ms=step.step_ms)

    # --- failure --------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait until every stream has run what was launched on it (errors ignored: already handled)."""
        for stream in (self.device.compute, self.device.upload, self.device.copy):
            try:
                await stream.record().wait_async()
            except Exception:  # noqa: BLE001 - the failure being recovered from
                pass

    def recover(self, steps: list[LaunchedStep]) -> bool:
        """After drain: free the failed steps' slots and clear the device's sticky errors. What the
        slots staged is forgotten: a failed stream may have skipped an upload."""
        for step in steps:
            if step.slot.owner is step:
                step.slot.abandon()
        for slot in self.slots:
            slot.staged = None
        return self.device.recover()

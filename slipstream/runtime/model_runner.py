"""Runs steps on a device: forward on the compute stream, sampling after it, the copy back.

The runner knows nothing about requests. It owns the model, the KV cache, the StepSlots and the
persistent batch: per-row device tables indexed by the row a sequence holds for its whole life —
runtime/row_tables.py (RowTables: each row's newest sampled token, next position, KV page-table
row, and sampling parameters with the index of its next output token). A step arrives as a
`ForwardInput` (runtime/batch.py); `launch_forward` takes the next free slot in turn, stages the
input in the slot's StepArena (staging.py, and static_step.py for mixed graphs) unless the slot
holds it already (a steady batch relaunches the same input: only new page-table entries are
staged), and returns the step's `LaunchedStep` (step_slot.py). The path, chosen once per staged
input (graph_choice.py): a decode graph (decode-only steps; a greedy decode graph also samples
plain greedy rows), a mixed graph (steps with prefill chunks), or eagerly. Stream order (a step's
table writes precede the next step's reads on the compute stream) keeps every read current at
depth 1 and 2.

Invariants, enforced by the scheduler and checked in tests (tests/fake_runner.py mirrors them):
  * row 0 is never held by a sequence: padding tokens use it, its page row stays all zeros (the
    scratch page), its position is reset to 0 by every step that has padding;
  * a row is handed to a new sequence only when no launched step references it, and the new
    sequence's first chunk rewrites its position, parameters and output index.

With `graphs` set (CUDA), a decode-only step replays the captured graph of its slot and bucket
(inputs gathered from the tables → layers → logits → positions advanced). With `mixed_graphs`
set, a step with prefill chunks of at most the largest token bucket replays the graph of its slot
and token bucket, reading the fixed-shape layout of slipstream/runtime/static_step.py. Any other
step, and every step of a model on the host (reference) attention, runs eagerly. An unmasked step
is sampled right behind its forward: plain greedy rows by RowTables.greedy (or inside a greedy
decode graph: forward_greedy), other rows by the SamplingLauncher (runtime/sampling_launch.py); a
masked step's groups come through launch_sampling. Then the runner launches the copy to the slot's
host landing buffers (on the copy stream; on a unified-memory device, on the compute stream). A
step with a row whose sequence has carry tokens (a carry step, runtime/carry.py) replays, when
decode-only, the carry decode graph of its slot and bucket (`carry_graphs`: forward_carry, which
also swaps in the head encodings and returns the hidden states); a carry step with chunks runs eagerly.
A speculating step goes to runtime/spec_step.py (its own graphs: `spec_graphs`). With speculation on,
every forward writes its inputs into the token history (inside the graphs too).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from slipstream.errors import PipelineInvariantError
from slipstream.intmath import round_up
from slipstream.models.kernels.attention import AttentionMetadata, DeviceAttentionMetadata
from slipstream.models.carry_kind import CarryKind
from slipstream.models.base import ForwardBatch, KVCache, Model
from slipstream.models.lora import LoraInput, LoraWeights
from slipstream.runtime.batch import ForwardInput
from slipstream.runtime.host_copy import copy_to_host, upload_array
from slipstream.runtime.carry import ChunkCarry, carry_input, read_carried, stage_chunk_carry
from slipstream.runtime.encoder_launch import EncoderLaunch
from slipstream.runtime.graph_choice import GraphChoice
from slipstream.runtime.step_slot import LaunchedStep, Staged, StepSlot
from slipstream.runtime.row_tables import RowTables
from slipstream.runtime.runner_api import SampledTokens
from slipstream.runtime.sampling_launch import SamplingLauncher
from slipstream.runtime.spec_step import SpecRunner
from slipstream.runtime.staging import StepArena, StepTensors
from slipstream.runtime.static_step import StaticStepTensors, fill_static, static_inputs

if TYPE_CHECKING:
    from slipstream.faults import FaultInjector



class ModelRunner(GraphChoice, EncoderLaunch):
    """Implements slipstream.runtime.runner_api.Runner on a Device."""

    def __init__(self, model: Model, kv: KVCache, device, max_rows: int, max_tokens: int,
                 max_pages: int, num_slots: int = 2, row_multiple: int = 1):
        self.model, self.kv, self.device = model, kv, device
        self.row_multiple = row_multiple  # pad steps so CPU matmul rows do not depend on batch size
        self.rows = RowTables(max_rows, max_pages, model.config.vocab_size, device.torch_device)
        max_tokens = round_up(max(max_tokens, max_rows), row_multiple)
        self.slots = [StepSlot(i, device, max_rows, model.config.vocab_size,
                               StepArena(device, max_tokens, max_rows, max_pages)) for i in range(num_slots)]
        self.vocab_size = model.config.vocab_size
        self._turn = 0  # the slot the next step takes if it is free
        self.sampler = SamplingLauncher(device, self.rows, model)
        self._faults: FaultInjector | None = None
        # encoder outputs by image digest; which are kept is the scheduler's EncoderCache's decision.
        # Written by encode launches and read by forwards, both on the compute stream (stream order)
        self.features: dict[bytes, torch.Tensor] = {}
        self.eager_steps = 0  # steps launched without a graph (stats(): on CUDA, 0 in steady serving)
        self.spec: SpecRunner | None = None  # speculating steps (runtime/spec_step.py; EngineConfig.speculative)
        # with speculation on, steps are timed on the compute stream (SampledTokens.step_ms): the cost
        # table cannot know the device (CUDA: graphed plain steps beside eager speculating ones; a CPU
        # whose multi-position forward is dearer than the table's machine's). CPU marks read the compute
        # thread's CPU time, which other processes on a shared machine do not inflate
        self.spec_timed = False
        # LoRA adapters by slot (0: none), replaced whole so a forward reads one consistent tuple; a
        # row's slot is its row-table column (SamplingRow.lora), gathered per token (docs/lora.md)
        self.lora_adapters: tuple[LoraWeights | None, ...] = (None,)

    def set_lora(self, slot: int, weights: LoraWeights | None) -> None:
        """Put an adapter in `slot` (>= 1), or empty it. The caller hands a slot out only when no live
        row reads it (api/lora.py), so a step in flight sees the old or the new tuple alike."""
        assert slot >= 1, "slot 0 is the base model"
        adapters = list(self.lora_adapters) + [None] * max(0, slot + 1 - len(self.lora_adapters))
        adapters[slot] = weights
        while len(adapters) > 1 and adapters[-1] is None:
            adapters.pop()
        self.lora_adapters = tuple(adapters)

    def lora_input(self, token_rows: torch.Tensor) -> LoraInput | None:
        """Each token's adapter slot from its row's column (None while no adapter is loaded: no cost)."""
        adapters = self.lora_adapters
        if len(adapters) == 1:
            return None
        return LoraInput(self.rows.sampling.lora.index_select(0, token_rows), adapters)

    @property
    def arenas(self) -> list[StepArena]:
        return [slot.arena for slot in self.slots]

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

    # --- forward --------------------------------------------------------------------------------

    def forward_from(self, t: StepTensors | StaticStepTensors, host_attention: bool = False,
                     embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
                     carry: tuple[torch.Tensor, torch.Tensor] | None = None,
                     bidirectional_lens: list[int] | None = None) -> Any:
        """The forward on staged inputs, gathering decode rows' state from the row tables and
        advancing their positions; also what a graph captures (decode: a bucket-padded StepTensors;
        mixed: StaticStepTensors, which needs the device attention). `carry` (a carry step): the
        chunk tokens' kinds and values; the decode rows' come from the row tables on the device,
        and the forward returns (logits, hidden) (runtime/carry.py)."""
        if isinstance(t, StaticStepTensors):
            assert carry is None, "a carry step never runs on the static (graph) layout"
            if host_attention:
                raise ValueError("a static (graph-shaped) step needs the device attention backend")
            ids, positions, kv_indices, meta = static_inputs(self.rows, t, self.kv.page_size,
                                                             None if self.spec is None else self.spec.history)
            if len(self.lora_adapters) > 1:  # (EngineConfig refuses LoRA where graphs run)
                raise NotImplementedError("LoRA adapters in a captured graph")
            return self.model(ForwardBatch(input_ids=ids, positions=positions, kv_indices=kv_indices,
                                           sample_indices=t.sample_indices, attn=meta), self.kv)
        r, ps = self.rows, self.kv.page_size
        dec = t.decode_rows
        dec_pos = r.pos.index_select(0, dec)
        dec_ids = r.last_token.index_select(0, dec)
        if t.decode_only:  # one token per sequence: the decode rows are the step
            ids, positions, token_rows, seq_rows, kv_lens = dec_ids, dec_pos, dec, dec, dec_pos + 1
        else:
            ids = torch.cat([dec_ids, t.chunk_ids])
            positions = torch.cat([dec_pos, t.chunk_pos])
            token_rows = torch.cat([dec, t.chunk_token_rows])
            kv_lens = torch.cat([dec_pos + 1, t.chunk_ends])
            seq_rows = torch.cat([dec, t.chunk_rows])
        kv_indices = r.kv_indices(token_rows, positions, ps)
        r.set_positions(seq_rows, kv_lens, t.scratch)  # each sequence's next position is its context length
        if self.spec is not None:  # the drafter's history, inside the forward (and its graph: no launch of its own)
            self.spec.history.write_inputs(token_rows, positions, ids, seq_rows, kv_lens)
        if host_attention:  # the reference attention loops over sequences on the host (CPU)
            kv_host = kv_lens.tolist()
            # only the columns the longest sequence uses (the device path keeps the static width)
            page_table = r.pages[seq_rows, :-(-max(kv_host, default=1) // ps)]
            meta = AttentionMetadata(t.query_start.tolist(), kv_host, page_table, ps)
        else:
            page_table = r.pages[seq_rows]
            meta = AttentionMetadata([], [], [], ps)
        # (Moondream's BOS + image prefix; None: all causal, and no upload)
        bidi = None if bidirectional_lens is None else upload_array(np.asarray(bidirectional_lens, np.int64),
                                                                     kv_lens.device)
        meta.on_device = DeviceAttentionMetadata(t.query_start, kv_lens, page_table, t.max_q_len,
                                                 bidirectional_lens=bidi)
        meta.bidirectional_lens = bidirectional_lens
        batch = ForwardBatch(input_ids=ids, positions=positions, kv_indices=kv_indices,
                             sample_indices=t.sample_indices, attn=meta, lora=self.lora_input(token_rows))
        if embeds is not None:  # image placeholders take encoder rows (never in a graph: _choose_graph)
            batch.embed_rows, batch.embeds = embeds
        if carry is not None:
            batch.carry, batch.return_hidden = carry_input(r, dec, dec_ids, *carry), True
        return self.model(batch, self.kv)  # a non-final prefill chunk samples nothing but fills KV

    def forward_carry(self, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_from of a decode-only carry step: every row's kind (from its newest token and its
        carry map) and values (the carry table) are read on the device, the head encodings replace
        the token embeddings with torch.where, and (logits, hidden) come back. Fixed shapes, no host
        read: what a carry decode graph captures (padding rows, row 0, have kind 0)."""
        return self.forward_from(t, carry=ChunkCarry(0).to_device(self.rows.device))

    def forward_greedy(self, t: StepTensors, slot: StepSlot) -> torch.Tensor:
        """forward_from plus the sampling of a decode step whose rows are all plain greedy (no
        temperature, logprobs, penalties, min_p/min_tokens, grammar mask): argmax, the last-token
        table, the output indices and the slot's sampled ids — what a greedy decode graph
        captures, so such a step launches no sampling kernels. Padding rows (row 0) write row 0.
        Returns the ids: a graph holding them keeps no [bucket, vocab] logits alive."""
        return self.rows.greedy(self.forward_from(t), t.sample_rows, slot.sampled)

    def launch_forward(self, step_id: int, packed: ForwardInput, unmasked: bool = False) -> LaunchedStep:
        """Enqueue the forward of one step into a free slot; returns at once. `unmasked`: no row of
        the step carries a grammar mask, so every row is sampled right behind the forward and its
        tokens copied (no launch_sampling follows), and a decode step whose rows are all plain
        greedy may replay the graph that samples too. The same ForwardInput launched again (a
        steady batch) runs as staged in the slot last time it ran there: nothing is staged, chosen
        or uploaded."""
        if packed.num_drafts is not None:  # a speculating step: its own path (runtime/spec_step.py)
            assert self.spec is not None, "a step with drafts on a runner without speculation"
            return self.spec.launch(step_id, packed)
        slot = self._free_slot()
        staged = slot.staged
        if staged is None or staged.packed is not packed or staged.unmasked is not unmasked:
            if (staged is not None and staged.unmasked is unmasked and packed.decode_rows is staged.packed.decode_rows
                    and not packed.chunks):  # the same rows: only other page-table entries
                staged = self._restage_writes(slot, staged, packed)
            else:
                staged = self._stage(slot, packed, unmasked)
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
            self._launch_copy(step)
        return step

    def _free_slot(self) -> StepSlot:
        """The next slot in turn that is free (ping-pong: steps alternate slots when both are free)."""
        slots = self.slots
        n = len(slots)
        for k in range(n):
            slot = slots[(self._turn + k) % n]
            if slot.owner is None:
                self._turn = (slot.index + 1) % n
                return slot
        raise PipelineInvariantError("no free StepSlot although fewer than depth steps are in flight")

    def _stage(self, slot: StepSlot, packed: ForwardInput, unmasked: bool) -> Staged:
        """Stage `packed` in the slot's arena: row mirrors, its path (graph or eager), the upload."""
        sampling = self.rows.sampling
        if packed.chunks:
            sampling.mirror(packed.chunks)
        # a row that may carry a head value makes the step a carry step (runtime/carry.py)
        carry = bool(sampling.carry_rows) and (sampling.any_carry(packed.sample_rows)
                                               or any(w.carry for w in packed.chunks))
        needs = sampling.needs(packed.sample_rows)
        graphed = self._choose_graph(slot, packed, unmasked, carry, needs)
        arena = slot.arena
        lay = arena.fill(packed, pad_decode=graphed.bucket if graphed is not None and not graphed.mixed else 0)
        if graphed is not None and graphed.mixed:
            fill_static(arena, packed, graphed.bucket)
        arena.upload()
        writes = lay.w or lay.c
        staged = Staged(packed, unmasked, graphed, arena.tensors(lay), arena.updates(lay) if writes else None, carry,
                        stage_chunk_carry(packed) if carry and graphed is None else None, needs)
        slot.staged = staged
        return staged

    @staticmethod
    def _restage_writes(slot: StepSlot, staged: Staged, packed: ForwardInput) -> Staged:
        """`packed` shares every array but its page-table entries with the input the slot holds
        (ForwardInput.with_page_writes): only those are staged; path, views and needs stay."""
        updates = slot.arena.stage_writes(packed.page_writes) if len(packed.page_writes) else None
        staged = replace(staged, packed=packed, updates=updates)
        slot.staged = staged
        return staged

    def _launch_graph(self, step: LaunchedStep) -> None:
        slot, staged = step.slot, step.staged
        graphed = staged.graphed
        self._check_other_slots_sampled(step)
        graphed.cache.replays[slot.index, graphed.bucket] += 1
        rows, graph, samples, carry = self.rows, graphed.graph, graphed.samples, graphed.carry
        updates, packed, step_id = staged.updates, staged.packed, step.step_id
        before = self._known_before(packed)

        def forward() -> None:
            self._check_fault(step_id)
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
                self._check_fault(step_id)
                if updates is not None:
                    rows.apply(updates, packed)
                if before is not None:
                    before()
                step.logits = self.forward_from(tensors, host_attention)

            self.device.compute.launch(forward, "forward")
            return
        slot, bidi = step.slot, packed.bidirectional_lens

        def forward_with() -> None:
            self._check_fault(step_id)
            if updates is not None:
                rows.apply(updates, packed)
            if before is not None:
                before()
            embeds = self._embeds(packed, tensors.decode_rows.shape[0]) if packed.embed_sources else None
            if carry is None:
                step.logits = self.forward_from(tensors, host_attention, embeds, None, bidi)
                return
            slot.carry_out.zero_()  # rows sampled by a group without carry rows carry nothing
            step.logits, step.hidden = self.forward_from(tensors, host_attention, embeds,
                                                         carry.to_device(rows.device), bidi)

        self.device.compute.launch(forward_with, "forward")

    def _known_before(self, packed: ForwardInput):
        """With speculation on, the history write a step's forward runs first (SpecRunner.known_before)."""
        return None if self.spec is None or not packed.chunks else self.spec.known_before(packed)

    def _check_fault(self, step_id: int) -> None:
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
            self._launch_copy(step)

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

    def _launch_copy(self, step: LaunchedStep, copy_out=None) -> None:
        """The step's tokens to the host, behind its final sampling: on a device whose host memory
        is device memory (the CPU) in stream order on the compute stream (no copy engine to overlap,
        no second stream to wake and wait for), else on the copy stream after an event. `copy_out`:
        a speculating step's copy (its runs)."""
        step.sampled = True
        compute = self.device.compute
        if step.started is not None:
            step.ended = compute.mark()
        if copy_out is None:
            copy_out = lambda: self._copy_out(step)  # noqa: E731
        if self.device.unified_memory:
            compute.launch(copy_out, "d2h")
            step.copy_done = compute.record()
            return
        copy = self.device.copy
        copy.wait(compute.record())  # the copy waits for exactly this step's outputs
        copy.launch(copy_out, "d2h")
        step.copy_done = copy.record()

    @staticmethod
    def _copy_out(step: LaunchedStep) -> None:
        """The step's outputs to the slot's host landing buffers (on whichever stream runs it)."""
        slot, n = step.slot, step.num_samples
        copy_to_host(slot.host_stamp_and_sampled[:n + 1], slot.stamp_and_sampled[:n + 1])
        if step.logprobs:
            copy_to_host(slot.host_logprobs[:n], slot.logprobs[:n])
        if step.staged.carry:  # only the rows' own (kind, values): never read back by a later step
            copy_to_host(slot.host_carry[:n], slot.carry_out[:n])
        if step.top_k:  # whole rows: [:n, :top] would be a strided view (host_copy.py)
            copy_to_host(slot.host_top_values[:n], slot.top_values[:n])
            copy_to_host(slot.host_top_ids[:n], slot.top_ids[:n])

    def _check_other_slots_sampled(self, step: LaunchedStep) -> None:
        """All graphs share one memory pool: a replay may overwrite memory that holds another
        graph's logits. Safe because a step's sampling is all enqueued (the tick finalizes it)
        before the next step is launched, so stream order runs it before this replay."""
        for other in self.slots:
            owner = other.owner
            if owner is not None and owner is not step and not owner.sampled:
                raise PipelineInvariantError(f"step {step.step_id} replays a graph while step {owner.step_id}'s "
                                             "sampling is not launched: the replay could overwrite its logits")

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

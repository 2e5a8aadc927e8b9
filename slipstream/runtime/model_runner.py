"""Runs steps on a device: forward on the compute stream, sampling after it, D2H on the copy stream.

The runner knows nothing about requests. It owns the model, the KV cache, the StepSlots and the
persistent batch: per-row device tables indexed by the row a sequence holds for its whole life —
runtime/row_tables.py (RowTables: each row's newest sampled token, next position, KV page-table
row, and sampling parameters with the index of its next output token). A step arrives as a
`ForwardInput` (runtime/batch.py); the runner stages it in the slot's StepArena (staging.py, and
static_step.py for mixed graphs) and runs it on one of three paths, chosen by `_choose_graph`:
a decode graph (decode-only steps; a greedy decode graph also samples plain greedy rows), a mixed
graph (steps with prefill chunks), or eagerly. A decode step uploads only its row ids; stream
order (a step's table writes precede the next step's reads on the compute stream) keeps every
read current at depth 1 and 2.

Invariants, enforced by the scheduler and checked in tests (tests/fake_runner.py mirrors them):
  * row 0 is never held by a sequence: padding tokens use it, its page row stays all zeros (the
    scratch page), its position is reset to 0 by every step;
  * a row is handed to a new sequence only when no launched step references it, and the new
    sequence's first chunk rewrites its position, parameters and output index.

With `graphs` set (CUDA), a decode-only step replays the captured graph of its slot and bucket
(inputs gathered from the tables → layers → logits → positions advanced). With `mixed_graphs`
set, a step with prefill chunks of at most the largest token bucket replays the graph of its slot
and token bucket, reading the fixed-shape layout of slipstream/runtime/static_step.py. Any other
step, and every step of a model on the host (reference) attention, runs eagerly. Sampling is
eager (runtime/sampling_launch.py: SamplingLauncher), except in a greedy decode graph (forward_greedy).
A step with a row whose sequence has carry tokens (a carry step, runtime/carry.py) replays, when
decode-only, the carry decode graph of its slot and bucket (`carry_graphs`: forward_carry, which
also swaps in the head encodings and returns the hidden states); a carry step with chunks runs eagerly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from slipstream.errors import PipelineInvariantError
from slipstream.intmath import round_up
from slipstream.models.attention import AttentionMetadata, DeviceAttentionMetadata
from slipstream.models.carry_kind import CarryKind
from slipstream.models.llama import ForwardBatch, KVCache, LlamaForCausalLM
from slipstream.runtime.batch import ForwardInput, ImageSpan
from slipstream.runtime.host_copy import stage_pixels, upload_array
from slipstream.runtime.carry import ChunkCarry, carry_input, read_carried, stage_chunk_carry
from slipstream.runtime.step_slot import StepSlot, SlotState
from slipstream.runtime.graphs import GraphCache
from slipstream.runtime.row_tables import RowTables
from slipstream.runtime.runner_api import SampledTokens
from slipstream.runtime.sampling_launch import SamplingLauncher
from slipstream.runtime.staging import RowUpdates, StepArena, StepTensors
from slipstream.runtime.static_step import StaticStepTensors, fill_static, static_inputs

if TYPE_CHECKING:
    from slipstream.faults import FaultInjector


@dataclass(frozen=True)
class _Graphed:
    """How a step replays a captured graph (no _Graphed: it runs eagerly)."""

    cache: GraphCache
    bucket: int  # rows (decode) or tokens (mixed) the graph was captured for
    graph: Any  # what the cache's capture returned: .replay() -> logits (or ids when `samples`)
    mixed: bool  # a mixed graph: reads the static layout (static_step.py), not a padded decode layout
    samples: bool  # a greedy decode graph: it samples every row too (launch_sampling only stamps)
    carry: bool = False  # a carry decode graph: replay() -> (logits, hidden) (forward_carry)


class ModelRunner:
    """Implements slipstream.runtime.runner_api.Runner on a Device."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, device, max_rows: int, max_tokens: int,
                 max_pages: int, num_slots: int = 2, row_multiple: int = 1):
        self.model, self.kv, self.device = model, kv, device
        self.row_multiple = row_multiple  # pad steps so CPU matmul rows do not depend on batch size
        self.rows = RowTables(max_rows, max_pages, model.config.vocab_size, device.torch_device)
        self.slots = [StepSlot(i, device, max_rows, model.config.vocab_size) for i in range(num_slots)]
        max_tokens = round_up(max(max_tokens, max_rows), row_multiple)
        self.arenas = [StepArena(device, max_tokens, max_rows, max_pages) for _ in range(num_slots)]
        self.vocab_size = model.config.vocab_size
        self.graphs: GraphCache | None = None  # CUDA graphs of decode steps (slipstream/runtime/cuda_graphs.py)
        self.mixed_graphs: GraphCache | None = None  # ... of mixed/prefill steps, by token bucket
        self.greedy_graphs: GraphCache | None = None  # decode graphs that also sample (all rows plain greedy)
        self.carry_graphs: GraphCache | None = None  # decode graphs of carry steps (forward_carry)
        self.sampler = SamplingLauncher(device, self.rows, model)
        self._faults: FaultInjector | None = None
        # encoder outputs by image digest; which are kept is the scheduler's EncoderCache's decision.
        # Written by encode launches and read by forwards, both on the compute stream (stream order)
        self.features: dict[bytes, torch.Tensor] = {}

    @property
    def carry_kinds(self) -> tuple[CarryKind, ...]:
        """The model's carry heads' kinds (kind k is [k - 1]); empty: it has none."""
        heads = getattr(self.model, "carry_heads", None)
        return tuple(heads.kinds) if heads is not None else ()

    @property
    def faults(self) -> FaultInjector | None:
        """Tests only: a slipstream.faults.FaultInjector (None: no cost)."""
        return self._faults

    @faults.setter
    def faults(self, injector: FaultInjector | None) -> None:
        self._faults = self.sampler.faults = injector

    # --- images -------------------------------------------------------------------------------

    def launch_encoder(self, images: Sequence[ImageSpan]) -> None:
        """Enqueue the vision encoder on these images, on the compute stream (so every later forward
        finds their outputs); returns at once. Pixels go up from pinned memory (no host wait)."""
        vision = getattr(self.model, "vision", None)
        if vision is None:
            raise PipelineInvariantError("images launched on a model without a vision tower")
        # a model whose encoder needs more than pixels (Moondream: the crop tiling) encodes its own
        # preprocessed image, given its pixels on the device
        encode_image = getattr(self.model, "encode_image", None)
        dev, features = self.device.torch_device, self.features
        items = list(images)

        def encode() -> None:
            for span in items:
                p = span.processed
                pixels = stage_pixels(p.pixel_values, dev)  # (pinned off the loop: host_copy.pin_pixels)
                if encode_image is not None:
                    out = encode_image(dataclasses.replace(p, pixel_values=pixels))
                else:
                    mask = getattr(p, "pixel_attention_mask", None)
                    mask = None if mask is None else np.asarray(mask)
                    # no padding (Idefics3's tiles never have any), known here on the host: no mask,
                    # so attention runs without a bias
                    mask = upload_array(mask, dev) if mask is not None and not mask.all() else None
                    out = vision.encode(pixels, mask)
                if out.shape[0] != span.num_features:
                    raise PipelineInvariantError(f"the encoder gave {out.shape[0]} rows for an image of "
                                                 f"{span.num_features} placeholders")
                features[span.digest] = out

        self.device.compute.launch(encode, "encode")

    def drop_features(self, digests: Sequence[bytes]) -> None:
        for digest in digests:
            self.features.pop(digest, None)

    def _embeds(self, packed: ForwardInput, num_decode: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(embed_rows, embeds) of a step with image rows, gathered on the compute stream when its
        forward runs (the encodes before it have run by then); None for a text-only step."""
        if not packed.has_embeds:
            return None
        dev = self.device.torch_device
        rows = upload_array(packed.embed_rows + num_decode, dev)
        parts = [self.features[digest][upload_array(index, dev)] for digest, index in packed.embed_sources]
        return rows, torch.cat(parts)

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
            ids, positions, kv_indices, meta = static_inputs(self.rows, t, self.kv.page_size)
            return self.model(ForwardBatch(input_ids=ids, positions=positions, kv_indices=kv_indices,
                                           sample_indices=t.sample_indices, attn=meta), self.kv)
        r, ps = self.rows, self.kv.page_size
        dec = t.decode_rows
        dec_pos = r.pos[dec]
        dec_ids = r.last_token[dec]
        ids = torch.cat([dec_ids, t.chunk_ids])
        positions = torch.cat([dec_pos, t.chunk_pos])
        token_rows = torch.cat([dec, t.chunk_token_rows])
        kv_indices = r.kv_indices(token_rows, positions, ps)
        kv_lens = torch.cat([dec_pos + 1, t.chunk_ends])
        seq_rows = torch.cat([dec, t.chunk_rows])
        r.set_positions(seq_rows, kv_lens)  # each sequence's next position is its context length
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
                             sample_indices=t.sample_indices, attn=meta)
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
        ids = self.forward_from(t).argmax(dim=-1)
        r, rows = self.rows, t.sample_rows
        out_index = r.sampling.output_index
        out_index.index_copy_(0, rows, out_index.index_select(0, rows) + 1)
        r.last_token.index_copy_(0, rows, ids)
        slot.sampled[:ids.shape[0]].copy_(ids)
        return ids

    def launch_forward(self, slot: StepSlot, step_id: int, packed: ForwardInput, unmasked: bool = False) -> None:
        """Enqueue the forward of one step into `slot`; returns at once. `unmasked`: no sampling
        group of this step will carry a grammar mask, so a decode step whose rows are all plain
        greedy may replay the graph that samples too (launch_sampling then only stamps it)."""
        slot.acquire(step_id)
        slot.num_samples = packed.num_samples
        self.rows.sampling.mirror(packed.chunks)
        # a row that may carry a head value makes the step a carry step (runtime/carry.py)
        slot.carry_step = self.rows.sampling.any_carry(packed.sample_rows) or any(w.carry for w in packed.chunks)
        graphed = self._choose_graph(slot, packed, unmasked)
        arena = self.arenas[slot.index]
        lay = arena.fill(packed, pad_decode=graphed.bucket if graphed is not None and not graphed.mixed else 0)
        if graphed is not None and graphed.mixed:
            fill_static(arena, packed, graphed.bucket)
        arena.upload()
        updates, tensors = arena.updates(lay), arena.tensors(lay)
        slot.sample_rows = tensors.sample_rows
        slot.sample_rows_host = packed.sample_rows
        if graphed is None:
            carry = stage_chunk_carry(packed) if slot.carry_step else None
            self._launch_eager(step_id, slot, packed, updates, tensors, carry)
        else:
            slot.sampled_in_graph = graphed.samples
            self._launch_graph(step_id, slot, packed, updates, graphed)

    def _choose_graph(self, slot: StepSlot, packed: ForwardInput, unmasked: bool) -> _Graphed | None:
        """The graph this step replays, capturing it on first use; None: the step runs eagerly.
        A carry step replays only a carry decode graph (decode-only); with chunks it runs eagerly."""
        if slot.carry_step:
            carry = self.carry_graphs
            hit = carry.lookup(slot.index, packed.num_decode) if carry is not None and self._graphable(packed) else None
            return None if carry is None or hit is None else _Graphed(carry, hit[0], hit[1], mixed=False,
                                                                       samples=False, carry=True)
        if self._graphable(packed):
            assert self.graphs is not None
            hit = self.graphs.lookup(slot.index, packed.num_decode)
            if hit is None:
                return None
            if unmasked and self.greedy_graphs is not None and self.rows.sampling.needs(packed.sample_rows).plain_greedy:
                greedy = self.greedy_graphs.lookup(slot.index, packed.num_decode)
                if greedy is not None:  # (the same buckets as self.graphs; None: its capture failed)
                    return _Graphed(self.greedy_graphs, greedy[0], greedy[1], mixed=False, samples=True)
            return _Graphed(self.graphs, hit[0], hit[1], mixed=False, samples=False)
        if self._mixed_graphable(packed):
            assert self.mixed_graphs is not None
            hit = self.mixed_graphs.lookup(slot.index, packed.num_tokens)
            if hit is not None:
                return _Graphed(self.mixed_graphs, hit[0], hit[1], mixed=True, samples=False)
        return None

    def _launch_graph(self, step_id: int, slot: StepSlot, packed: ForwardInput, updates: RowUpdates,
                      graphed: _Graphed) -> None:
        self._check_other_slots_sampled(slot)
        graphed.cache.replays[slot.index, graphed.bucket] += 1
        rows, graph, samples, carry = self.rows, graphed.graph, graphed.samples, graphed.carry

        def forward() -> None:
            self._check_fault(step_id)
            rows.apply(updates, packed)
            if carry:
                slot.carry_out.zero_()  # as eagerly: rows of groups without carry rows carry nothing
                slot.logits, slot.hidden = graph.replay()
                return
            out = graph.replay()
            slot.logits = None if samples else out

        self.device.compute.launch(forward, "forward")

    def _launch_eager(self, step_id: int, slot: StepSlot, packed: ForwardInput, updates: RowUpdates,
                      tensors: StepTensors, carry: ChunkCarry | None = None) -> None:
        rows, host_attention = self.rows, self.device.unified_memory
        bidi = packed.bidirectional_lens

        def forward() -> None:
            self._check_fault(step_id)
            rows.apply(updates, packed)
            embeds = self._embeds(packed, tensors.decode_rows.shape[0])
            if carry is None:
                slot.logits = self.forward_from(tensors, host_attention, embeds, None, bidi)
                return
            slot.carry_out.zero_()  # rows sampled by a group without carry rows carry nothing
            chunk = carry.to_device(rows.device)
            slot.logits, slot.hidden = self.forward_from(tensors, host_attention, embeds, chunk, bidi)

        self.device.compute.launch(forward, "forward")

    def _check_fault(self, step_id: int) -> None:
        if self._faults is not None:
            self._faults.check("forward", step_id)

    def launch_sampling(self, slot: StepSlot, packed: ForwardInput, rows: list[int] | None = None,
                        bitmask: np.ndarray | None = None, final: bool = True) -> None:
        """Enqueue sampling of some of the step's rows (SamplingLauncher.launch documents the arguments)."""
        self.sampler.launch(slot, packed, rows, bitmask, final)

    def _check_other_slots_sampled(self, slot: StepSlot) -> None:
        """All graphs share one memory pool: a replay may overwrite memory that holds another
        graph's logits. Safe because a step's sampling is all enqueued (the tick finalizes it)
        before the next step is launched, so stream order runs it before this replay."""
        for other in self.slots:
            if other is not slot and other.state is SlotState.IN_FLIGHT and other.sample_done is None:
                raise PipelineInvariantError(f"step {slot.step_id} replays a graph while step {other.step_id}'s "
                                             "sampling is not launched: the replay could overwrite its logits")

    def _graphable(self, packed: ForwardInput) -> bool:
        """Decode-only steps (one device-fed, sampled token per row; no CPU row padding)."""
        return self.graphs is not None and self.row_multiple == 1 and packed.num_decode > 0 and packed.decode_only

    def _mixed_graphable(self, packed: ForwardInput) -> bool:
        """Steps with prefill chunks, when the model reads device attention metadata (a graph cannot
        hold the host-side reference attention) and no CPU row padding is asked for."""
        return (self.mixed_graphs is not None and self.row_multiple == 1 and not packed.decode_only
                and self.model.backend == "triton" and not packed.has_embeds  # image rows: eager
                and packed.bidirectional_lens is None)  # (the graph's attention is plain causal)

    # --- commit ---------------------------------------------------------------------------------

    def is_done(self, slot: StepSlot) -> bool:
        return slot.copy_done is not None and slot.copy_done.query()

    async def read_sampled(self, slot: StepSlot) -> SampledTokens:
        """Await the step's copy event without blocking the loop, then read tokens and logprobs.
        Raises what launched work of the step (on any stream) raised."""
        if slot.copy_done is None:
            raise PipelineInvariantError(f"slot {slot.index}: step {slot.step_id} read before its final sampling launched")
        await slot.copy_done.wait_async()
        ids, logprobs = slot.read_host()
        top = None
        if slot.top_k:  # rows that asked for top_logprobs: {token id: logprob}, most likely first
            rows = slot.sample_rows_host
            want = self.rows.sampling.top_logprobs[rows]
            values, top_ids = slot.host_top_values[:len(ids)].tolist(), slot.host_top_ids[:len(ids)].tolist()
            top = {i: dict(zip(top_ids[i][:k], values[i][:k])) for i, k in enumerate(want.tolist()) if k}
        carried = None
        if slot.carry_step:
            carried = read_carried(slot.host_carry[:len(ids)].numpy(), [k.values for k in self.carry_kinds])
        return SampledTokens(ids, logprobs, top, carried)

    # --- failure --------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait until every stream has run what was launched on it (errors ignored: already handled)."""
        for stream in (self.device.compute, self.device.upload, self.device.copy):
            try:
                await stream.record().wait_async()
            except Exception:  # noqa: BLE001 - the failure being recovered from
                pass

    def recover(self, slots: list[StepSlot]) -> bool:
        """After drain: free the failed steps' slots and clear the device's sticky errors."""
        for slot in slots:
            slot.abandon()
        return self.device.recover()

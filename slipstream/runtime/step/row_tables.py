"""The persistent batch's per-row device state, indexed by the row a sequence holds for its life.

`RowTables` (always there):
  last_token[row] the row's newest sampled token (sampling scatters it; the next forward gathers it):
                  the last-token table
  pos[row]        the position of its next input token (advanced on the device by every step)
  pages[row]      its KV page-table row (entries written as the host hands pages out)
  sampling        the rows' sampling parameters and output indices (runtime/sampling/sampling_args.py:
                  SamplingTables, written from a chunk's `SamplingRow`, with host mirrors that let
                  the host choose a sampling group's kernels without a loop over rows), and its
                  carry tokens (`SamplingRow.carry`)
  carry_values[row] the head values its newest sampled token carries: the carry table. A row's
                  next input is typed: kind = sampling.carry_kinds(row, last_token[row]); kind 0
                  feeds the token id, kind k > 0 feeds the model's encoding of these values
                  (runtime/step/carry.py). The kind is derived, not stored, so a row handed to a new
                  sequence needs no reset: its chunk rewrites the carry tokens.
Private to the ModelRunner.

`StepForward`: the forward that reads and advances them (what eager steps run and graphs capture).

`HistoryTables` (allocated when the first row needs them, R × V × 6 bytes, inside the step's
apply on the compute stream: created outside it, the zero-fill would run on the legacy default
stream, which the engine's non-blocking streams do not wait for):
  output_counts [R, V] int32   tokens sampled so far (presence / frequency / repetition penalties)
  prompt_mask   [R, V] bool    tokens of the prompt (repetition)
  stop_mask     [R, V] bool    EOS and stop_token_ids (min_tokens)
rebuilt from a chunk's `history` (admission, or the recompute after a preemption) and counted
after each sampling on the same stream, so step t+1 sees token t without a host round trip.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from slipstream.runtime.batch import MAX_CARRY_VALUES, SCRATCH_ROW, ForwardInput
from slipstream.runtime.devices.host_copy import upload_array
from slipstream.runtime.sampling.logits_process import flat_rows, record_sampled, reset_rows
from slipstream.runtime.sampling.sampling_args import SamplingTables
from slipstream.models.base import ForwardBatch, KVCache, Model
from slipstream.models.kernels.attention import AttentionMetadata, DeviceAttentionMetadata
from slipstream.models.lora import LoraInput, LoraWeights
from slipstream.models.lora_bank import LoraBank
from slipstream.runtime.graphs.static_step import StaticStepTensors, static_inputs
from slipstream.runtime.step.carry import ChunkCarry, carry_input
from slipstream.runtime.step.staging import RowUpdates, StepTensors

if TYPE_CHECKING:
    from slipstream.runtime.step.step_slot import StepSlot


class RowTables:
    def __init__(self, max_rows: int, max_pages: int, vocab_size: int, device: torch.device):
        def z(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.device, self.max_rows, self.vocab_size = device, max_rows, vocab_size
        self.last_token = z(max_rows)  # each row's newest sampled token: a decode row's next input
        self.pos = z(max_rows)
        self.pages = z(max_rows, max_pages)
        self.sampling = SamplingTables(max_rows, device)
        self.carry_values = torch.zeros(max_rows, MAX_CARRY_VALUES, dtype=torch.float32, device=device)
        self.ones = torch.ones(max_rows, dtype=torch.int64, device=device)  # (greedy)
        self.history: HistoryTables | None = None

    def apply(self, u: RowUpdates, packed: ForwardInput) -> None:
        """Device-side writes of a step, before its forward (on the compute stream)."""
        if u.page_writes.shape[0]:
            w = u.page_writes
            self.pages[w[:, 0], w[:, 1]] = w[:, 2]
        if u.param_rows.shape[0]:
            self.sampling.write(u.param_rows, u.params_int, u.params_float)
        rebuild = [w for w in packed.chunks if w.history is not None]
        if rebuild:
            if self.history is None:  # here, on the compute stream: its zero-fill is ordered before every use
                self.history = HistoryTables(self.max_rows, self.vocab_size, self.device)
            self.history.rebuild(rebuild)

    def greedy(self, logits: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Sample plain greedy rows (no temperature, logprobs, penalties, min_p/min_tokens, mask,
        carry): argmax, each row's newest token and next output index, and the ids into `out` (a
        slot's sampled ids). What a greedy decode graph captures too; padding rows (row 0) write
        row 0."""
        ids = logits.argmax(dim=-1)
        self.sampling.output_index.index_add_(0, rows, self.ones[:rows.shape[0]])
        self.last_token.index_copy_(0, rows, ids)
        out[:ids.shape[0]].copy_(ids)
        return ids

    def kv_indices(self, token_rows: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
        """The KV index each token writes (its cache entry): its row's page for the position, and the offset in it."""
        return self.pages[token_rows, positions // page_size] * page_size + positions % page_size

    def set_positions(self, rows: torch.Tensor, positions: torch.Tensor, scratch: bool = True) -> None:
        """pos[rows] = positions (the step's context lengths), then (`scratch`: row 0 may be among
        them) the scratch row back to 0: padding rows and sequences use row 0, which must start
        every step at position 0."""
        self.pos.index_copy_(0, rows, positions)
        if scratch:
            self.pos[SCRATCH_ROW:SCRATCH_ROW + 1].zero_()


class HistoryTables:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str):
        device = torch.device(device)
        self.output_counts = torch.zeros(max_rows, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(max_rows, vocab_size, dtype=torch.bool, device=device)
        self.stop_mask = torch.zeros(max_rows, vocab_size, dtype=torch.bool, device=device)
        self.device = device

    def rebuild(self, chunks) -> None:
        """Rows whose sequence starts (or restarts) with these chunks: cleared, then filled."""
        self.admit([w.row for w in chunks], [w.history[0] for w in chunks], [w.history[1] for w in chunks],
                   [list(w.sampling.stop_ids) for w in chunks])

    def admit(self, rows: list[int], prompts: list[list[int]], outputs: list[list[int]],
              stops: list[list[int]]) -> None:
        """Rows taken by sequences: cleared, then filled from their prompts, outputs so far, stop ids.
        Everything travels in one array, staged in pinned memory and copied on the current (compute)
        stream without blocking the host (host_copy.upload_array)."""
        parts = [np.asarray(rows, np.int64)]
        for lists in (prompts, outputs, stops):
            parts += flat_rows(rows, lists)
        flat = upload_array(np.concatenate(parts), self.device)
        index, p_ids, p_rows, o_ids, o_rows, s_ids, s_rows = flat.split([len(p) for p in parts])
        reset_rows(self.output_counts, self.prompt_mask, self.stop_mask, index, p_ids, p_rows, o_ids, o_rows,
                   s_ids, s_rows)

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """After sampling (device tensors [n]): count each row's new token."""
        record_sampled(self.output_counts, rows, tokens)

    def gather(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.output_counts.index_select(0, rows), self.prompt_mask.index_select(0, rows),
                self.stop_mask.index_select(0, rows))


class StepForward:
    """The forward on a step's staged inputs: what the runner launches eagerly and what a graph captures
    (decode: a bucket-padded StepTensors; mixed: StaticStepTensors). It gathers the decode rows'
    state from the tables, advances their positions, writes the drafter's history with speculation
    on, and gives each token its LoRA adapter. Held by the ModelRunner (`runner.forward`); runs on the
    compute stream only. (Here, beside the tables it reads and advances: a steady step's path stays
    in few files, tests/test_step_trace.py.)"""

    def __init__(self, model: Model, kv: KVCache, rows: RowTables):
        self.model, self.kv, self.rows = model, kv, rows
        # with speculation on, the drafter's TokenHistory (set by SpecRunner): every forward writes its
        # inputs into it
        self.history: Any = None
        # LoRA adapters by slot (0: none), replaced whole so a forward reads one consistent tuple; a
        # row's slot is its row-table column (SamplingRow.lora), gathered per token (docs/lora.md)
        self.lora_adapters: tuple[LoraWeights | None, ...] = (None,)
        # the triton backend's device copy of every slot (models/lora_bank.py; set at assembly when
        # LoRA is on with CUDA): then every forward carries the slots, so graphs hold the LoRA kernels
        self.lora_bank: LoraBank | None = None

    def set_lora(self, slot: int, weights: LoraWeights | None, staged: tuple[torch.Tensor, ...] | None = None) -> None:
        """Put an adapter in `slot` (>= 1), or empty it. The caller hands a slot out only when no live
        row reads it (api/lora.py), so a step in flight sees the old or the new tuple alike. With a
        bank, the adapter's weights (`staged`: LoraBank.stage's, else staged here) are copied into the
        slot on the current stream (ModelRunner.set_lora: the compute stream); an emptied slot keeps
        its old weights, which only a finished request's row may still read."""
        assert slot >= 1, "slot 0 is the base model"
        if self.lora_bank is not None and weights is not None:
            self.lora_bank.install(slot, staged if staged is not None else self.lora_bank.stage(weights))
        adapters = list(self.lora_adapters) + [None] * max(0, slot + 1 - len(self.lora_adapters))
        adapters[slot] = weights
        while len(adapters) > 1 and adapters[-1] is None:
            adapters.pop()
        self.lora_adapters = tuple(adapters)

    def lora_input(self, token_rows: torch.Tensor) -> LoraInput | None:
        """Each token's adapter slot from its row's column (None while no adapter is loaded: no cost)."""
        adapters = self.lora_adapters
        if self.lora_bank is None and len(adapters) == 1:
            return None
        return LoraInput(self.rows.sampling.lora.index_select(0, token_rows), adapters, self.lora_bank)

    def logits(self, t: StepTensors | StaticStepTensors, host_attention: bool = False,
               embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
               carry: tuple[torch.Tensor, torch.Tensor] | None = None,
               bidirectional_lens: list[int] | None = None) -> Any:
        """The forward on staged inputs, gathering decode rows' state from the row tables and
        advancing their positions; also what a graph captures (decode: a bucket-padded StepTensors;
        mixed: StaticStepTensors, which needs the device attention). `carry` (a carry step): the
        chunk tokens' kinds and values; the decode rows' come from the row tables on the device,
        and the forward returns (logits, hidden) (runtime/step/carry.py)."""
        if isinstance(t, StaticStepTensors):
            assert carry is None, "a carry step never runs on the static (graph) layout"
            if host_attention:
                raise ValueError("a static (graph-shaped) step needs the device attention backend")
            ids, positions, kv_indices, meta = static_inputs(self.rows, t, self.kv.page_size,
                                                             self.history)
            if self.lora_bank is None and len(self.lora_adapters) > 1:  # (LoraGroups reads counts on the host)
                raise NotImplementedError("LoRA adapters in a captured graph need the device LoraBank "
                                          "(the triton backend's; models/lora_bank.py)")
            return self.model(ForwardBatch(input_ids=ids, positions=positions, kv_indices=kv_indices,
                                           sample_indices=t.sample_indices, attn=meta,
                                           lora=self.lora_input(t.token_rows)), self.kv)
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
        if self.history is not None:  # the drafter's history, inside the forward (and its graph: no launch of its own)
            self.history.write_inputs(token_rows, positions, ids, seq_rows, kv_lens)
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
        if embeds is not None:  # image placeholders take encoder rows (never in a graph: graph_choice.py)
            batch.embed_rows, batch.embeds = embeds
        if carry is not None:
            batch.carry, batch.return_hidden = carry_input(r, dec, dec_ids, *carry), True
        return self.model(batch, self.kv)  # a non-final prefill chunk samples nothing but fills KV

    def carry(self, t: StepTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` of a decode-only carry step: every row's kind (from its newest token and its
        carry map) and values (the carry table) are read on the device, the head encodings replace
        the token embeddings with torch.where, and (logits, hidden) come back. Fixed shapes, no host
        read: what a carry decode graph captures (padding rows, row 0, have kind 0)."""
        return self.logits(t, carry=ChunkCarry(0).to_device(self.rows.device))

    def greedy(self, t: StepTensors, slot: StepSlot) -> torch.Tensor:
        """`logits` plus the sampling of a decode step whose rows are all plain greedy (no
        temperature, logprobs, penalties, min_p/min_tokens, grammar mask): argmax, the last-token
        table, the output indices and the slot's sampled ids — what a greedy decode graph
        captures, so such a step launches no sampling kernels. Padding rows (row 0) write row 0.
        Returns the ids: a graph holding them keeps no [bucket, vocab] logits alive."""
        return self.rows.greedy(self.logits(t), t.sample_rows, slot.sampled)

"""The persistent batch's per-row device state, indexed by the row a sequence holds for its life.

`RowTables` (always there):
  last_token[row] the row's newest sampled token (sampling scatters it; the next forward gathers it):
                  the last-token table
  pos[row]        the position of its next input token (advanced on the device by every step)
  pages[row]      its KV page-table row (entries written as the host hands pages out)
  sampling        the rows' sampling parameters and output indices (runtime/sampling_args.py:
                  SamplingTables, written from a chunk's `SamplingRow`, with host mirrors that let
                  the host choose a sampling group's kernels without a loop over rows), and its
                  carry tokens (`SamplingRow.carry`)
  carry_values[row] the head values its newest sampled token carries: the carry table. A row's
                  next input is typed: kind = sampling.carry_kinds(row, last_token[row]); kind 0
                  feeds the token id, kind k > 0 feeds the model's encoding of these values
                  (runtime/carry.py). The kind is derived, not stored, so a row handed to a new
                  sequence needs no reset: its chunk rewrites the carry tokens.
Private to the ModelRunner.

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

import numpy as np
import torch

from slipstream.runtime.batch import MAX_CARRY_VALUES, SCRATCH_ROW, ForwardInput
from slipstream.runtime.host_copy import upload_array
from slipstream.runtime.logits_process import flat_rows, record_sampled, reset_rows
from slipstream.runtime.sampling_args import SamplingTables
from slipstream.runtime.staging import RowUpdates


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

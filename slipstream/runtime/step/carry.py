"""The carry on the runner side: typed row inputs whose values never leave the device between steps.

A row whose sequence has carry tokens (`SamplingRow.carry`: token id -> kind) feeds, after sampling
such a token, the head value of that kind instead of the token's embedding. Per step with a carry
row (a *carry step*; the host knows which rows may carry from its mirrors, never from the device):
  * the forward reads each decode row's kind from its sampled token (`SamplingTables.carry_kinds`)
    and its values from `RowTables.carry_values`, and returns the hidden states of the sample rows
    (`ForwardBatch.carry`, `return_hidden`);
  * each sampling group with a carry row decodes the values of the token it just sampled from those
    hidden states (`CarryHeads.decode`, every kind, chosen per row with torch.where), writes them
    into `carry_values` for the next forward, and into the slot's `carry_out` [kind, values...] for
    the step's device→host copy, which brings them to the commit (`SampledTokens.carried`) for the
    request's output and for a recompute after preemption;
  * chunks re-feed carried values the host kept (`SeqWork.carry`: a recompute), staged here.
Steps without a carry row run as before: no carry kernel, no extra copy. A decode-only carry step
replays a carry decode graph where decode steps are graphed (StepForward.carry: the same
reads, with fixed shapes); a carry step with chunks runs eagerly. Private to the ModelRunner.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.models.carry_heads import CarryHeads, CarryInput, decode_carry
from slipstream.runtime.batch import MAX_CARRY_VALUES, ForwardInput
from slipstream.runtime.devices.host_copy import upload_array


@dataclass(frozen=True)
class ChunkCarry:
    """Host-staged kinds [Tc] and values [Tc, MAX_CARRY_VALUES] of a step's chunk tokens (None
    fields: no chunk of the step re-feeds a carried value)."""

    num_tokens: int
    kinds: np.ndarray | None = None
    values: np.ndarray | None = None

    def to_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """On the compute stream (inside the step's forward): the device tensors."""
        if self.kinds is None or self.values is None:
            return (torch.zeros(self.num_tokens, dtype=torch.int64, device=device),
                    torch.zeros(self.num_tokens, MAX_CARRY_VALUES, dtype=torch.float32, device=device))
        return upload_array(self.kinds, device), upload_array(self.values, device)


def stage_chunk_carry(packed: ForwardInput) -> ChunkCarry:
    tc = len(packed.chunk_ids)
    if not any(w.carry for w in packed.chunks):
        return ChunkCarry(tc)
    kinds = np.zeros(tc, np.int64)
    values = np.zeros((tc, MAX_CARRY_VALUES), np.float32)
    at = 0
    for w in packed.chunks:
        for offset, kind, vals in w.carry:
            kinds[at + offset] = kind
            values[at + offset, :len(vals)] = vals
        at += w.num_tokens
    return ChunkCarry(tc, kinds, values)


def carry_input(rows, decode_rows: torch.Tensor, decode_tokens: torch.Tensor,
                chunk_kinds: torch.Tensor, chunk_values: torch.Tensor) -> CarryInput:
    """The step's typed inputs: decode rows' kinds from their newest token, values from the table."""
    kinds = rows.sampling.carry_kinds(decode_rows, decode_tokens)
    return CarryInput(torch.cat([kinds, chunk_kinds]),
                      torch.cat([rows.carry_values.index_select(0, decode_rows), chunk_values]))


def sample_carry(rows, heads: CarryHeads, table_rows: torch.Tensor, ids: torch.Tensor,
                 hidden: torch.Tensor) -> torch.Tensor:
    """After a group sampled `ids` for `table_rows`: decode each row's values from `hidden`, write
    them into the carry table, and return [n, 1 + MAX_CARRY_VALUES] (kind, values) for the copy."""
    kinds = rows.sampling.carry_kinds(table_rows, ids)
    values = decode_carry(heads, kinds, hidden, MAX_CARRY_VALUES)
    rows.carry_values.index_copy_(0, table_rows, values)
    return torch.cat([kinds[:, None].float(), values], dim=1)


def read_carried(host: np.ndarray, widths: list[int]) -> dict[int, tuple[int, tuple[float, ...]]]:
    """From a step's copied (kind, values) rows: sampling row -> (kind, its values), carry rows only."""
    out = {}
    for i in np.flatnonzero(host[:, 0]).tolist():
        kind = int(host[i, 0])
        out[i] = (kind, tuple(float(v) for v in host[i, 1:1 + widths[kind - 1]]))
    return out

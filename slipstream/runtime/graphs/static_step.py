"""Mixed and prefill steps staged at one fixed shape per token bucket: what a mixed graph replays.

A captured graph replays fixed kernels on fixed buffers, so every shape it reads, and every grid,
must depend only on its bucket, never on the step. For a bucket of T tokens, with S the arena's
sequence capacity, N = min(T, S) sampling rows and P = attention_blocks.num_query_programs(T, S):
  token_ids / token_pos / token_rows / token_fed  [T]
      the step's tokens (decode rows first, then the chunks' tokens, as in batch.py), then padding
      tokens: id 0, position 0, row 0, so they write their K/V to the scratch page and belong to no
      sequence. `fed` = 1 marks a decode row's token: its id and position are gathered from the row
      tables on the device (the host never knows them at launch).
  seq_rows / seq_ends / seq_fed  [S]
      decode rows (kv length = position + 1, read on the device), chunks (kv length = chunk end),
      then padding sequences: row 0, q_len 0, kv length 0.
  query_start [S+1]   padding sequences start and end at the last real token.
  sample_indices [N]  each sampling row's token, then 0 (computed, never sampled).
  blocks [2, P]       the attention kernel's program table (its grid no longer needs max_q_len).
Everything is written with vectorised numpy, no Python per row. Row-table writes of the step
(page entries, chunk parameters, history rebuilds) are applied before the replay from the step's
unpadded layout, exactly as for decode graphs, so they need no padding here.

Real rows compute what the eager forward computes: the same ids, positions, KV indices, context
lengths and query blocks; only the matmuls' row count differs (padding rows). Private to the ModelRunner.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.models.kernels.attention import AttentionMetadata, DeviceAttentionMetadata
from slipstream.models.kernels.attention_blocks import num_query_programs, query_blocks
from slipstream.runtime.batch import SCRATCH_ROW, ForwardInput


def static_sizes(tokens: int, max_seqs: int) -> tuple[int, int, int]:
    """(S, N, P) of a bucket of `tokens` for an arena of `max_seqs` sequences."""
    return max_seqs, min(tokens, max_seqs), num_query_programs(tokens, max_seqs)


def static_regions(max_tokens: int, max_seqs: int) -> list[tuple[str, int]]:
    """Arena regions (name, int64 entries) sized for the largest bucket."""
    s, n, p = static_sizes(max_tokens, max_seqs)
    t = max_tokens
    return [("s_token_ids", t), ("s_token_pos", t), ("s_token_rows", t), ("s_token_fed", t), ("s_seq_rows", s),
            ("s_seq_ends", s), ("s_seq_fed", s), ("s_query_start", s + 1), ("s_sample_indices", n),
            ("s_blocks", 2 * p)]


@dataclass(frozen=True)
class StaticStepTensors:
    """Device views of a bucket's fixed-shape inputs (see the module docstring)."""

    tokens: int  # the bucket T
    token_ids: torch.Tensor
    token_pos: torch.Tensor
    token_rows: torch.Tensor
    token_fed: torch.Tensor
    seq_rows: torch.Tensor
    seq_ends: torch.Tensor
    seq_fed: torch.Tensor
    query_start: torch.Tensor
    sample_indices: torch.Tensor
    blocks: torch.Tensor


def fill_static(arena, packed: ForwardInput, tokens: int) -> None:
    """Write `packed` into the arena's static regions for a bucket of `tokens` (padding included)."""
    s, n_rows, p = static_sizes(tokens, arena.max_seqs)
    d, c = packed.num_decode, len(packed.chunk_rows)
    real = packed.num_tokens
    tc = real - d
    if real > tokens or d + c > s or packed.num_samples > n_rows or packed.pad_tokens or packed.pad_samples:
        raise ValueError(f"step of {real} tokens / {d + c} sequences / {packed.num_samples} samples (row padding "
                         f"{packed.pad_tokens}) does not fit a static bucket of {tokens} / {s} / {n_rows}")
    h = arena.host_region
    ids, pos, rows, fed = (h(name, tokens) for name in ("s_token_ids", "s_token_pos", "s_token_rows", "s_token_fed"))
    ids[:d], ids[d:real], ids[real:] = 0, packed.chunk_ids[:tc], 0
    pos[:d], pos[d:real], pos[real:] = 0, packed.chunk_pos[:tc], 0
    rows[:d], rows[d:real], rows[real:] = packed.decode_rows, packed.chunk_token_rows[:tc], SCRATCH_ROW
    fed[:d], fed[d:] = 1, 0
    seq_rows, seq_ends, seq_fed = (h(name, s) for name in ("s_seq_rows", "s_seq_ends", "s_seq_fed"))
    seq_rows[:d], seq_rows[d:d + c], seq_rows[d + c:] = packed.decode_rows, packed.chunk_rows, SCRATCH_ROW
    seq_ends[:d], seq_ends[d:d + c], seq_ends[d + c:] = 0, packed.chunk_ends, 0
    seq_fed[:d], seq_fed[d:] = 1, 0
    qs = h("s_query_start", s + 1)
    qs[:d + 1] = np.arange(d + 1)
    qs[d + 1:d + c + 1] = d + packed.chunk_query_start[1:]
    qs[d + c + 1:] = real
    sample = h("s_sample_indices", n_rows)
    sample[:d] = np.arange(d)
    sample[d:packed.num_samples] = packed.chunk_sample_index
    sample[packed.num_samples:] = 0
    h("s_blocks", 2 * p)[:] = query_blocks(np.diff(qs), p).reshape(-1)
    arena.mark_static_used()


def static_tensors(arena, tokens: int) -> StaticStepTensors:
    """The device views a bucket's graph reads (fixed addresses, fixed shapes)."""
    s, n_rows, p = static_sizes(tokens, arena.max_seqs)
    v = arena.dev_region
    return StaticStepTensors(
        tokens=tokens, token_ids=v("s_token_ids", tokens), token_pos=v("s_token_pos", tokens),
        token_rows=v("s_token_rows", tokens), token_fed=v("s_token_fed", tokens), seq_rows=v("s_seq_rows", s),
        seq_ends=v("s_seq_ends", s), seq_fed=v("s_seq_fed", s), query_start=v("s_query_start", s + 1),
        sample_indices=v("s_sample_indices", n_rows), blocks=v("s_blocks", 2 * p).view(2, p))


def static_inputs(rows, t: StaticStepTensors, page_size: int, history=None):
    """(input ids, positions, KV indices, attention metadata) of a static step, gathered on the
    device from the row tables, which it advances (decode rows by one, chunks to their end); with
    speculation on, its inputs also go into the token history (`history`, in the graph)."""
    fed = t.token_fed != 0
    ids = torch.where(fed, rows.last_token[t.token_rows], t.token_ids)
    positions = torch.where(fed, rows.pos[t.token_rows], t.token_pos)
    kv_indices = rows.kv_indices(t.token_rows, positions, page_size)
    kv_lens = torch.where(t.seq_fed != 0, rows.pos[t.seq_rows] + 1, t.seq_ends)
    rows.set_positions(t.seq_rows, kv_lens)  # padding sequences write 0 to row 0
    if history is not None:
        history.write_inputs(t.token_rows, positions, ids, t.seq_rows, kv_lens)
    meta = AttentionMetadata([], [], [], page_size)
    meta.on_device = DeviceAttentionMetadata(t.query_start, kv_lens, rows.pages[t.seq_rows], t.tokens, t.blocks)
    return ids, positions, kv_indices, meta

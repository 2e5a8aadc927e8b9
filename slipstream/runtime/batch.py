"""What one step asks of the device, in plain Python (no torch), and how it is packed.

The scheduler describes a step as a list of `SeqWork`; the runtime packs it into flat arrays for
the model. Decode tokens are not known on the host when the step is planned: `SeqWork.tokens is
None` means "one token, read on the device from the carry-over table at `row`".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slipstream.intmath import round_up

# Page 0 is never handed to a sequence: padding rows write their K/V there, so padded rows need
# no masking of their writes.
SCRATCH_PAGE = 0


@dataclass(frozen=True)
class SamplingRow:
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    seed: int = 0  # a request seed or one drawn at admission; combined with the output index
    logprobs: bool = False  # also return the sampled token's log-probability


@dataclass
class SeqWork:
    row: int  # carry-over table row of this sequence (stable while it lives)
    tokens: list[int] | None  # prefill chunk tokens; None = one decode token from the device
    start_pos: int  # position of the first token of this work
    pages: list[int]  # page-table row, long enough for start_pos + num_tokens
    sample: bool  # this work ends at a position whose next token is sampled
    output_index: int = 0  # index of the token being sampled in the request's output (for seeds)
    sampling: SamplingRow = field(default_factory=SamplingRow)

    @property
    def num_tokens(self) -> int:
        return 1 if self.tokens is None else len(self.tokens)


@dataclass
class PackedStep:
    """Flat host arrays of one step (what gets copied host→device)."""

    input_ids: np.ndarray  # [T] host tokens (0 where read from the device)
    from_device: np.ndarray  # [T] bool, decode tokens
    carry_rows: np.ndarray  # [T] carry-over row per token (0 for host tokens)
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    sample_indices: np.ndarray  # [N] token rows that sample (padded)
    sample_rows: np.ndarray  # [n] carry-over rows receiving the sampled tokens (unpadded)
    query_start: list[int]
    kv_lens: list[int]
    page_tables: list[list[int]]
    num_tokens: int  # real tokens (T minus padding)
    num_samples: int  # real samples (n)


def pack_step(works: list[SeqWork], page_size: int, row_multiple: int = 1) -> PackedStep:
    """Flatten a step. Padding rows to `row_multiple` keeps matmul rows independent of batch size."""
    n_tok = sum(w.num_tokens for w in works)
    t_pad = round_up(n_tok, row_multiple)
    input_ids = np.zeros(t_pad, np.int64)
    from_device = np.zeros(t_pad, bool)
    carry_rows = np.zeros(t_pad, np.int64)
    positions = np.zeros(t_pad, np.int64)
    slot_mapping = np.full(t_pad, SCRATCH_PAGE * page_size, np.int64)
    query_start, kv_lens, sample_idx, sample_rows = [0], [], [], []
    cur = 0
    for w in works:
        n = w.num_tokens
        pos = np.arange(w.start_pos, w.start_pos + n)
        if w.tokens is None:
            from_device[cur] = True
            carry_rows[cur] = w.row
        else:
            input_ids[cur : cur + n] = w.tokens
        pages = np.asarray(w.pages, np.int64)
        positions[cur : cur + n] = pos
        slot_mapping[cur : cur + n] = pages[pos // page_size] * page_size + pos % page_size
        cur += n
        query_start.append(cur)
        kv_lens.append(w.start_pos + n)
        if w.sample:
            sample_idx.append(cur - 1)
            sample_rows.append(w.row)
    n_samples = len(sample_idx)
    sample_idx += [0] * (round_up(n_samples, row_multiple) - n_samples)
    return PackedStep(
        input_ids=input_ids,
        from_device=from_device,
        carry_rows=carry_rows,
        positions=positions,
        slot_mapping=slot_mapping,
        sample_indices=np.asarray(sample_idx, np.int64),
        sample_rows=np.asarray(sample_rows, np.int64),
        query_start=query_start,
        kv_lens=kv_lens,
        page_tables=[w.pages for w in works],
        num_tokens=n_tok,
        num_samples=n_samples,
    )

"""A ForwardBatch built on the host from explicit chunks and page lists — for model-level tests and
tools that call the model directly, without an engine (the engine's steps come from the runner's
row tables instead: slipstream/runtime/model_runner.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from slipstream.intmath import round_up
from slipstream.models.kernels.attention import AttentionMetadata
from slipstream.models.base import ForwardBatch

SCRATCH_PAGE = 0  # padding tokens write their K/V here (never a sequence's page)


@dataclass
class Chunk:
    tokens: list[int]
    start_pos: int  # position of the first token; earlier positions must already be in the cache
    pages: list[int]  # the sequence's pages, enough for start_pos + len(tokens)
    sample: bool = True  # return logits for the chunk's last token


def host_batch(chunks: list[Chunk], page_size: int, row_multiple: int = 1,
               device: str | torch.device = "cpu") -> tuple[ForwardBatch, int]:
    """(batch, number of sampled rows); tokens and sampled rows are padded to `row_multiple`."""
    ids, positions, slots, query_start, kv_lens, samples = [], [], [], [0], [], []
    for c in chunks:
        for i, tok in enumerate(c.tokens):
            pos = c.start_pos + i
            ids.append(tok)
            positions.append(pos)
            slots.append(c.pages[pos // page_size] * page_size + pos % page_size)
        query_start.append(len(ids))
        kv_lens.append(c.start_pos + len(c.tokens))
        if c.sample:
            samples.append(len(ids) - 1)
    n_samples = len(samples)
    pad = round_up(len(ids), row_multiple) - len(ids)
    ids += [0] * pad
    positions += [0] * pad
    slots += [SCRATCH_PAGE * page_size] * pad
    samples += [0] * (round_up(n_samples, row_multiple) - n_samples)

    def t(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    meta = AttentionMetadata(query_start, kv_lens, [c.pages for c in chunks], page_size)
    return ForwardBatch(t(ids), t(positions), t(slots), t(samples), meta), n_samples

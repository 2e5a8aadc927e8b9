"""What one step asks of the device, in plain Python (no torch): `ForwardInput`, built by `pack_step`.

This module and runner_api.py are all of the runtime the scheduler and the API import; the
runner's staging (staging.py, static_step.py, sampling_args.py, row_tables.py) is private to it.

The batch is persistent: each admitted sequence owns a row of the runner's per-row device tables
for its whole life (last sampled token, next position, page-table row, sampling parameters,
output index). A step therefore names
  * `decode_rows`: rows that feed one token each from the device and sample — nothing else about
    them is sent, their inputs are gathered on the device from the row tables;
  * `chunks`: host-known tokens (a prompt chunk, or a recompute after preemption) as `SeqWork`,
    which also (re)write their row's position, sampling parameters and output index;
  * `page_writes`: (row, index, page) entries added to page-table rows since the last step.
So a step of N decoding sequences costs the host N row ids, not N rebuilt rows.

Layout of a ForwardInput (token order = sequence order = sampling-row order): the decode rows
first, then the chunks; sampling rows are every decode row, then each chunk that ends at its
sequence's newest known token.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from slipstream.intmath import round_up

# Page 0 is never handed to a sequence and row 0 is never given to one: padding tokens belong to
# row 0, whose page-table row stays all zeros, so they write their K/V to the scratch page.
SCRATCH_PAGE = 0
SCRATCH_ROW = 0
MAX_TOP_LOGPROBS = 20  # the most top_logprobs a request may ask for (as OpenAI); StepSlot's buffer width
MAX_CARRY_TOKENS = 4  # the most carry tokens a sequence may have (SamplingRow.carry)
MAX_CARRY_KIND = 255  # carry kinds are 1..MAX_CARRY_KIND
MAX_CARRY_VALUES = 4  # the most values one carry kind may have (the width of the row tables' carry table)


@dataclass(frozen=True)
class SamplingRow:
    """A sequence's sampling parameters as the runner's row tables hold them (slipstream/params.py
    documents each). Built from SamplingParams in api/engine_submit.py; runtime/sampling/sampling_args.py is
    the one runtime file that reads its fields (into the row tables, then `SamplingArgs` per sampling
    group)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0
    seed: int = 0  # a request seed or one drawn at admission; combined with the output index
    logprobs: bool = False  # also return the sampled token's log-probability
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    top_logprobs: int = 0  # also the k most likely tokens with their logprobs
    stop_ids: tuple[int, ...] = ()  # EOS (unless ignored) and stop_token_ids: what min_tokens holds back
    # carry tokens (token id, carry kind >= 1): after sampling such a token the row's next input is
    # the value of that kind decoded from this step's hidden state (docs/moondream.md, "The carry")
    carry: tuple[tuple[int, int], ...] = ()
    lora: int = 0  # the LoRA adapter slot the row computes with (0: the base model; docs/lora.md)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def needs_history(self) -> bool:
        """Its row needs the history tables (token counts, prompt and stop masks)."""
        return self.penalized or self.min_tokens > 0


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image of a prompt: its encoder output (`num_features` rows) replaces, in order, the
    placeholder tokens at `positions`, all in [start, end) (start: the first, end: one past the last).
    `digest` keys its encoder output (the encoder cache) and joins the block hash of every page it
    overlaps; `processed` is what the runner's encoder takes (opaque to the scheduler)."""

    start: int
    end: int
    digest: bytes
    num_features: int
    processed: Any = None
    positions: np.ndarray | None = None  # [num_features] int64; None: the run start..start + num_features

    def __post_init__(self) -> None:
        if self.positions is None:
            object.__setattr__(self, "positions", np.arange(self.start, self.start + self.num_features, dtype=np.int64))
        pos = self.positions
        assert pos is not None and len(pos) == self.num_features > 0, "an image has one position per feature"
        assert int(pos[0]) == self.start and int(pos[-1]) == self.end - 1, "start/end are its first/last positions + 1"

    def overlaps(self, lo: int, hi: int) -> bool:
        return self.start < hi and lo < self.end


@dataclass(frozen=True, eq=False)
class ImageSlice:
    """The part of one image a chunk feeds: its tokens at `token_index` (within the chunk) take the
    encoder output's rows `feature_index`."""

    digest: bytes
    token_index: np.ndarray  # [k] int64
    feature_index: np.ndarray  # [k] int64


def image_slices(images: list[ImageSpan], lo: int, hi: int) -> list[ImageSlice]:
    """The image rows a chunk of positions [lo, hi) feeds (a chunk may start or end inside an image)."""
    out = []
    for span in images:
        if not span.overlaps(lo, hi):
            continue
        pos = span.positions
        assert pos is not None
        first, last = np.searchsorted(pos, lo), np.searchsorted(pos, hi)
        if first < last:
            out.append(ImageSlice(span.digest, pos[first:last] - lo, np.arange(first, last, dtype=np.int64)))
    return out


@dataclass
class SeqWork:
    """A chunk of host-known tokens of one sequence."""

    row: int  # the sequence's row (stable while it is admitted)
    tokens: list[int]
    start_pos: int  # position of the first token
    sample: bool  # the chunk ends at the sequence's newest known token: its next token is sampled
    output_index: int = 0  # index in the request's output of the next sampled token (seeds)
    sampling: SamplingRow = field(default_factory=SamplingRow)
    # (prompt ids, output ids so far) on a sequence's first chunk when its sampling needs the row's
    # history tables (penalties, min_tokens): they are rebuilt from it (admission, or a recompute)
    history: tuple[list[int], list[int]] | None = None
    images: list[ImageSlice] = field(default_factory=list)  # image rows among its tokens (embeddings)
    # known inputs that are head values (a recompute of a sequence with carried outputs): (offset
    # in `tokens`, carry kind, values); those positions take the head's encoding, not the token's
    carry: tuple[tuple[int, int, tuple[float, ...]], ...] = ()
    # its sequence's bidirectional prefix when the chunk has queries inside it (0: plain causal);
    # the chunk then reaches the prefix's end (the planner never splits it)
    bidirectional_len: int = 0
    # with speculation, the first chunk after prefix-cache hits: the known tokens before it, which
    # the drafter's history needs (speculation/policy.py); None otherwise
    known_before: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def end_pos(self) -> int:
        return self.start_pos + len(self.tokens)


@dataclass
class ForwardInput:
    """A step's device inputs as flat host arrays: what the scheduler hands the runner (staged and
    copied host→device by the runner's StepArena)."""

    decode_rows: np.ndarray  # [d] rows fed from the device
    chunk_ids: np.ndarray  # [Tc] host tokens of the chunks, then padding (0)
    chunk_pos: np.ndarray  # [Tc] their positions
    chunk_token_rows: np.ndarray  # [Tc] their rows (SCRATCH_ROW for padding)
    chunk_rows: np.ndarray  # [c] row per chunk
    chunk_query_start: np.ndarray  # [c + 1] offsets of the chunks within the chunk tokens
    chunk_ends: np.ndarray  # [c] kv length after each chunk
    chunk_sample_index: np.ndarray  # [sc] token index (within the step) of each sampling chunk's last token
    sample_rows: np.ndarray  # [n] rows receiving the sampled tokens: decode rows, then sampling chunks
    page_writes: np.ndarray  # [w, 3] (row, index, page)
    chunks: list[SeqWork]  # the chunks themselves (their sampling parameters, output indices)
    num_tokens: int  # real tokens (decode + chunk tokens, without padding)
    pad_tokens: int  # padding tokens appended after the chunk tokens (row_multiple)
    pad_samples: int  # padding sampling rows (row_multiple)
    # image rows: chunk-token indices whose embedding is an encoder output row, and where each run
    # of them comes from ((digest, rows of that image's output), in embed_rows order)
    embed_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    embed_sources: list[tuple[bytes, np.ndarray]] = field(default_factory=list)
    # per sequence (decode rows, then chunks) the bidirectional prefix (AttentionMetadata's); None: all causal
    bidirectional_lens: list[int] | None = None
    # a speculating step (no chunks): how many drafts each decode row feeds after its last token
    # (speculation/runner.py); None: one token per decode row
    num_drafts: np.ndarray | None = None

    @property
    def has_embeds(self) -> bool:
        return len(self.embed_rows) > 0

    @property
    def num_decode(self) -> int:
        return len(self.decode_rows)

    @property
    def num_seqs(self) -> int:
        return len(self.decode_rows) + len(self.chunk_rows)

    @property
    def num_samples(self) -> int:
        return len(self.sample_rows)

    @property
    def decode_only(self) -> bool:
        return not self.chunks

    def with_page_writes(self, page_writes: np.ndarray) -> "ForwardInput":
        """This input with other page-table entries (a steady batch's step whose rows got pages):
        everything else is these very arrays, so a runner that staged this input stages only them."""
        return replace(self, page_writes=page_writes)

    @property
    def max_query_len(self) -> int:
        q = np.diff(self.chunk_query_start)
        return max(int(q.max()) if len(q) else 1, 1)


_NO_WRITES = np.zeros((0, 3), np.int64)


def pack_step(decode_rows: np.ndarray, chunks: list[SeqWork], page_writes: np.ndarray | None = None,
              row_multiple: int = 1, num_drafts: list[int] | None = None) -> ForwardInput:
    """Flatten a step. Padding tokens and sampling rows to `row_multiple` keeps CPU matmul rows
    independent of the batch size (batch invariance); a speculating step (`num_drafts`, decode rows
    only) is padded by the runner, which lays out its positions."""
    if num_drafts is not None:
        assert not chunks, "a speculating step has no chunks"
        row_multiple = 1
    d = len(decode_rows)
    n_chunk_tok = sum(len(w.tokens) for w in chunks)
    n_tok = d + n_chunk_tok
    pad = round_up(n_tok, row_multiple) - n_tok
    tc = n_chunk_tok + pad
    chunk_ids = np.zeros(tc, np.int64)
    chunk_pos = np.zeros(tc, np.int64)
    chunk_token_rows = np.full(tc, SCRATCH_ROW, np.int64)
    query_start = [0]
    sample_index, sample_chunk_rows = [], []
    embed_rows: list[np.ndarray] = []
    embed_sources: list[tuple[bytes, np.ndarray]] = []
    at = 0
    for w in chunks:
        n = len(w.tokens)
        for part in w.images:
            embed_rows.append(at + part.token_index)
            embed_sources.append((part.digest, part.feature_index))
        chunk_ids[at:at + n] = w.tokens
        chunk_pos[at:at + n] = np.arange(w.start_pos, w.start_pos + n)
        chunk_token_rows[at:at + n] = w.row
        at += n
        query_start.append(at)
        if w.sample:
            sample_index.append(d + at - 1)
            sample_chunk_rows.append(w.row)
    decode_rows = np.asarray(decode_rows, np.int64)
    n_samples = d + len(sample_index)
    return ForwardInput(
        decode_rows=decode_rows,
        chunk_ids=chunk_ids,
        chunk_pos=chunk_pos,
        chunk_token_rows=chunk_token_rows,
        chunk_rows=np.asarray([w.row for w in chunks], np.int64),
        chunk_query_start=np.asarray(query_start, np.int64),
        chunk_ends=np.asarray([w.end_pos for w in chunks], np.int64),
        chunk_sample_index=np.asarray(sample_index, np.int64),
        sample_rows=np.concatenate([decode_rows, np.asarray(sample_chunk_rows, np.int64)]),
        page_writes=_NO_WRITES if page_writes is None or not len(page_writes) else np.asarray(page_writes, np.int64),
        chunks=chunks,
        num_tokens=n_tok,
        pad_tokens=pad,
        pad_samples=round_up(n_samples, row_multiple) - n_samples,
        embed_rows=np.concatenate(embed_rows) if embed_rows else np.zeros(0, np.int64),
        embed_sources=embed_sources,
        bidirectional_lens=([0] * d + [w.bidirectional_len for w in chunks]
                            if any(w.bidirectional_len for w in chunks) else None),
        num_drafts=None if num_drafts is None else np.asarray(num_drafts, np.int64),
    )

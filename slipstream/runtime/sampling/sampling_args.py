"""Sampling parameters on the device, private to the ModelRunner: per-row tables written from each
chunk's `SamplingRow`, and the `SamplingArgs` one sampling group gathers from them.

This is the runtime file that reads SamplingRow's fields (batch.py defines it; besides it only
HistoryTables reads its stop ids), by attribute, never by name: renaming a field breaks here at
once, under mypy, not when a step happens to sample.

Path of a request's parameters: SamplingParams (params.py) → SamplingRow (api/engine_submit.py, carried by
Sequence and SeqWork) → `stage_params` (host arena, at launch) → `SamplingTables.write` (device
rows, before the forward) → `SamplingTables.gather` → `SamplingArgs` → sampler.sample_group.

A group's kernels are chosen on the host without touching the device: `SamplingTables` keeps a host
mirror of each row's needs as bits (one gather and one OR-reduce per group), and `gather` leaves a
field of SamplingArgs None when no row of the group needs it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple, Sequence as Seq

import numpy as np
import torch

from slipstream.runtime.batch import MAX_CARRY_KIND, MAX_CARRY_TOKENS, SamplingRow, SeqWork

class IntColumn(IntEnum):
    """The rows of the int parameter table, by name: the one place their order is declared
    (`stage_params` writes them, `SamplingTables` reads them, tests check a staged chunk by name).
    CARRY is the first of MAX_CARRY_TOKENS columns: a row's carry tokens (SamplingRow.carry), one
    int each, packed as token id << 8 | kind; unused entries are NO_CARRY, which matches no token."""

    TOP_K = 0
    SEED = 1
    OUTPUT_INDEX = 2  # advanced on the device by every sample of the row
    LOGPROBS = 3
    MIN_TOKENS = 4
    CARRY = 5
    LORA = CARRY + MAX_CARRY_TOKENS  # the row's LoRA adapter slot (0: the base model; docs/lora.md)


class FloatColumn(IntEnum):
    """The rows of the float parameter table, by name."""

    TEMPERATURE = 0
    TOP_P = 1
    PRESENCE_PENALTY = 2
    FREQUENCY_PENALTY = 3
    REPETITION_PENALTY = 4
    MIN_P = 5


NO_CARRY = -1
NUM_INTS, NUM_FLOATS = IntColumn.LORA + 1, len(FloatColumn)


def stage_params(chunks: Seq[SeqWork], ints: np.ndarray, floats: np.ndarray) -> None:
    """Write the chunks' parameters into host arrays [NUM_INTS, c] and [NUM_FLOATS, c], column by name."""
    rows = [w.sampling for w in chunks]
    ints[IntColumn.TOP_K] = [s.top_k for s in rows]
    ints[IntColumn.SEED] = [s.seed for s in rows]
    ints[IntColumn.OUTPUT_INDEX] = [w.output_index for w in chunks]
    ints[IntColumn.LOGPROBS] = [s.logprobs for s in rows]
    ints[IntColumn.MIN_TOKENS] = [s.min_tokens for s in rows]
    ints[IntColumn.LORA] = [s.lora for s in rows]
    carry = ints[IntColumn.CARRY:IntColumn.CARRY + MAX_CARRY_TOKENS]
    carry[:] = NO_CARRY
    for j, s in enumerate(rows):
        for k, (token, kind) in enumerate(s.carry):
            carry[k, j] = token << 8 | kind
    floats[FloatColumn.TEMPERATURE] = [s.temperature for s in rows]
    floats[FloatColumn.TOP_P] = [s.top_p for s in rows]
    floats[FloatColumn.PRESENCE_PENALTY] = [s.presence_penalty for s in rows]
    floats[FloatColumn.FREQUENCY_PENALTY] = [s.frequency_penalty for s in rows]
    floats[FloatColumn.REPETITION_PENALTY] = [s.repetition_penalty for s in rows]
    floats[FloatColumn.MIN_P] = [s.min_p for s in rows]


# host mirror bits: what a row needs from the sampling kernels
_RANDOM, _FILTERED, _LOGPROBS, _PENALIZED, _MIN_TOKENS, _MIN_P, _TOP_LOGPROBS, _CARRY = (1 << i for i in range(8))


def _needs(s: SamplingRow) -> int:
    random = s.temperature > 0
    return ((_RANDOM if random else 0) | (_FILTERED if random and (s.top_k > 0 or s.top_p < 1.0) else 0)
            | (_LOGPROBS if s.logprobs or s.top_logprobs > 0 else 0) | (_PENALIZED if s.penalized else 0)
            | (_MIN_TOKENS if s.min_tokens > 0 else 0) | (_MIN_P if random and s.min_p > 0 else 0)
            | (_TOP_LOGPROBS if s.top_logprobs > 0 else 0) | (_CARRY if s.carry else 0))


class TopKTopP(NamedTuple):
    top_k: torch.Tensor  # <= 0: no top-k for that row
    top_p: torch.Tensor  # >= 1: no top-p


class Draw(NamedTuple):
    """What random rows need (rows with temperature 0 in the group stay greedy)."""

    temperature: torch.Tensor
    seed: torch.Tensor
    filter: TopKTopP | None  # None: no random row filters


class Penalties(NamedTuple):
    presence: torch.Tensor
    frequency: torch.Tensor
    repetition: torch.Tensor


@dataclass(frozen=True)
class GroupNeeds:
    """What a sampling group needs, decided on the host at launch from the rows' mirrors."""

    random: bool  # some row has temperature > 0
    filtered: bool  # some random row uses top-k or top-p
    penalties: bool  # some row has presence / frequency != 0 or repetition != 1
    min_tokens: bool  # some row has min_tokens > 0
    min_p: bool  # some random row has min_p > 0
    logprobs: bool  # some row wants its sampled token's logprob
    top_logprobs: int  # the largest top_logprobs of the group (0: none)
    carry: bool = False  # some row has carry tokens: the group decodes head values (row_tables.py)
    # argmax is all the group needs (what a greedy decode graph may sample); derived, read every step
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plain_greedy", not (self.random or self.penalties or self.min_tokens
                                                      or self.logprobs or self.carry))


@dataclass(frozen=True)
class SamplingArgs:
    """Per-row parameters [n] of one sampling group. A field left None means no row of the group needs
    that kernel (a group of plain greedy rows carries only `output_index`)."""

    output_index: torch.Tensor  # index of the token being sampled in each row's output (seeds, min_tokens)
    draw: Draw | None = None  # None: every row greedy
    penalties: Penalties | None = None  # None: no row penalised
    min_tokens: torch.Tensor | None = None  # None: no row holds back its stop tokens
    min_p: torch.Tensor | None = None  # None: no random row has min_p > 0 (implies `draw`)

    @property
    def needs_history(self) -> bool:
        """The penalties or min_tokens read the rows' HistoryTables."""
        return self.penalties is not None or self.min_tokens is not None


class SamplingTables:
    """Device tables [NUM_INTS, R] int64 and [NUM_FLOATS, R] float32, indexed by row, plus their host
    mirrors (need bits and top_logprobs per row)."""

    def __init__(self, max_rows: int, device: torch.device):
        self.ints = torch.zeros(NUM_INTS, max_rows, dtype=torch.int64, device=device)
        self.floats = torch.zeros(NUM_FLOATS, max_rows, dtype=torch.float32, device=device)
        self.output_index = self.ints[IntColumn.OUTPUT_INDEX]
        self.carry_maps = self.ints[IntColumn.CARRY:IntColumn.CARRY + MAX_CARRY_TOKENS]  # [MAX_CARRY_TOKENS, R] packed
        self.lora = self.ints[IntColumn.LORA]  # [R] each row's adapter slot: what a forward's tokens gather
        self._needs = np.zeros(max_rows, np.uint8)
        self.top_logprobs = np.zeros(max_rows, np.int64)  # per row (read_sampled keeps each row's own k)
        self.carry_rows: set[int] = set()  # rows whose sequence has carry tokens (empty: no step checks more)

    def mirror(self, chunks: Seq[SeqWork]) -> None:
        """At launch, from the same chunks whose parameters the step writes on the device."""
        for w in chunks:
            self._needs[w.row] = _needs(w.sampling)
            self.top_logprobs[w.row] = w.sampling.top_logprobs
            if w.sampling.carry:
                self.carry_rows.add(w.row)
            elif self.carry_rows:
                self.carry_rows.discard(w.row)

    def any_carry(self, host_rows: np.ndarray) -> bool:
        """Whether a row of `host_rows` has carry tokens (one set test when no row anywhere has)."""
        return bool(self.carry_rows) and bool(np.bitwise_or.reduce(self._needs[host_rows]) & _CARRY) \
            if len(host_rows) else False

    def carry_kinds(self, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[n] the carry kind each row's token `tokens[i]` starts (0: none), on the device."""
        maps = self.carry_maps[:, rows]  # [MAX_CARRY_TOKENS, n]
        hit = (maps >> 8) == tokens[None, :]
        return torch.where(hit, maps & MAX_CARRY_KIND, 0).sum(0)

    def needs(self, host_rows: np.ndarray) -> GroupNeeds:
        """One gather and one OR-reduce over the rows' need bits: no Python loop over rows."""
        bits = int(np.bitwise_or.reduce(self._needs[host_rows])) if len(host_rows) else 0
        return GroupNeeds(random=bool(bits & _RANDOM), filtered=bool(bits & _FILTERED),
                          penalties=bool(bits & _PENALIZED), min_tokens=bool(bits & _MIN_TOKENS),
                          min_p=bool(bits & _MIN_P), logprobs=bool(bits & _LOGPROBS),
                          top_logprobs=int(self.top_logprobs[host_rows].max()) if bits & _TOP_LOGPROBS else 0,
                          carry=bool(bits & _CARRY))

    def write(self, rows: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Device side of `stage_params` (on the compute stream, before the step's forward)."""
        self.ints.index_copy_(1, rows, ints)
        self.floats.index_copy_(1, rows, floats)

    def gather(self, rows: torch.Tensor, needs: GroupNeeds) -> SamplingArgs:
        """The group's parameters on the device (`rows` [n]), only the fields `needs` asks for."""
        i = self.ints[:, rows]
        output_index, min_tokens = i[IntColumn.OUTPUT_INDEX], i[IntColumn.MIN_TOKENS] if needs.min_tokens else None
        if not (needs.random or needs.penalties):
            return SamplingArgs(output_index, min_tokens=min_tokens)
        f = self.floats[:, rows]
        draw = None
        if needs.random:
            filtered = TopKTopP(i[IntColumn.TOP_K], f[FloatColumn.TOP_P]) if needs.filtered else None
            draw = Draw(f[FloatColumn.TEMPERATURE], i[IntColumn.SEED], filtered)
        penalties = Penalties(f[FloatColumn.PRESENCE_PENALTY], f[FloatColumn.FREQUENCY_PENALTY],
                              f[FloatColumn.REPETITION_PENALTY]) if needs.penalties else None
        return SamplingArgs(output_index, draw=draw, penalties=penalties, min_tokens=min_tokens,
                            min_p=f[FloatColumn.MIN_P] if needs.min_p else None)

    def advance(self, rows: torch.Tensor, args: SamplingArgs) -> None:
        """After a group sampled: each row's next token has the next output index."""
        self.output_index.index_copy_(0, rows, args.output_index + 1)

"""Region skills (point, detect) for a model with region heads (Moondream): carry tokens, no text.

The model's logits only choose whether another object follows: at the start of an object the
allowed tokens are the coordinate token and EOS; after it, the object's remaining carry tokens are
forced. `point` is (coordinate x, coordinate y) per object, `detect` adds a size (width, height).
Each carry token's value comes from the model's head (docs/moondream.md, "The carry"), so the
result is read from `CompletionOutput.carried`, not from text (`region_result`). After
`max_objects` objects only EOS may follow (the engine then stops, as the reference's loop does).

Since EOS ends the request, the allowed set at output index i is a function of i alone (which token
of which object it is): the matcher has `mask_by_output_index`, so the engine samples its rows at
launch even at depth 2 (grammar/base.py, IndexMaskMatcher).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping

import numpy as np

from slipstream.errors import GrammarCompileError, GrammarMatchError
from slipstream.grammar.base import GrammarSpec
from slipstream.grammar.bitmask import set_allowed, words_for
from slipstream.models.carry_kind import CarryKind

COORDINATE, SIZE = CarryKind("coordinate", 1), CarryKind("size", 2)
REGION_KINDS = ("point", "detect")


class RegionGrammar:
    def __init__(self, kind: str, max_objects: int, coord_id: int, size_id: int, eos_ids: list[int],
                 vocab_size: int) -> None:
        if kind not in REGION_KINDS:
            raise GrammarCompileError(f"unknown region skill {kind!r} (expected one of {', '.join(REGION_KINDS)})")
        if not eos_ids:
            raise GrammarCompileError(f"{kind} grammar: the tokenizer has no EOS token")
        bad = [t for t in (coord_id, size_id, *eos_ids) if not 0 <= t < vocab_size]
        if bad:
            raise GrammarCompileError(f"{kind} grammar: tokens {bad} lie outside the logits ({vocab_size})")
        self.kind, self.max_objects = kind, max_objects
        self.coord_id, self.size_id, self.eos_ids = coord_id, size_id, list(eos_ids)
        # the tokens of one object: x and y (coordinates), then for detect the size
        self.cycle = (coord_id, coord_id) if kind == "point" else (coord_id, coord_id, size_id)
        self.carry_tokens = {coord_id: COORDINATE} if kind == "point" else {coord_id: COORDINATE, size_id: SIZE}

        def row(ids) -> np.ndarray:
            r = np.zeros(words_for(vocab_size), dtype=np.int32)
            set_allowed(r, ids)
            r.setflags(write=False)
            return r

        self.start_row = row([coord_id, *self.eos_ids])  # another object, or the end
        self.eos_row = row(self.eos_ids)
        self.token_rows = {t: row([t]) for t in set(self.cycle)}

    def matcher(self) -> RegionMatcher:
        return RegionMatcher(self)


class RegionMatcher:
    """State: objects completed, the position inside the current object, terminated."""

    depends_on_previous_token = True  # (the late path, for a request with stop strings)
    mask_by_output_index = True

    def __init__(self, grammar: RegionGrammar) -> None:
        self.g = grammar
        self._objects, self._pos = 0, 0
        self._terminated = grammar.max_objects == 0
        self._history: list[tuple[int, int, bool]] = []

    def is_terminated(self) -> bool:
        return self._terminated

    def _row(self, pos: int, terminated: bool) -> np.ndarray:
        if terminated:
            return self.g.eos_row
        if pos == 0:
            return self.g.start_row
        return self.g.token_rows[self.g.cycle[pos]]

    def fill_bitmask(self, row: np.ndarray) -> None:
        _copy(self._row(self._pos, self._terminated), row)

    def mask_for_output_index(self, index: int, row: np.ndarray) -> None:
        # no EOS before `index` (it would have ended the request): index objects of len(cycle) tokens
        objects, pos = divmod(index, len(self.g.cycle))
        _copy(self._row(pos, objects >= self.g.max_objects), row)

    def accept(self, token: int) -> None:
        g, token = self.g, int(token)
        state = (self._objects, self._pos, self._terminated)
        objects, pos, term = state
        if term or (pos == 0 and token in g.eos_ids):
            if token not in g.eos_ids:
                self._reject(token)
            term = True
        elif token != g.cycle[pos]:
            self._reject(token)
        elif pos + 1 == len(g.cycle):
            objects, pos = objects + 1, 0
            term = objects >= g.max_objects
        else:
            pos += 1
        self._history.append(state)
        self._objects, self._pos, self._terminated = objects, pos, term

    def rollback(self, n: int) -> None:
        if n < 0 or n > len(self._history):
            raise GrammarMatchError(f"cannot roll back {n} tokens: only {len(self._history)} accepted")
        if n:
            self._objects, self._pos, self._terminated = self._history[-n]
            del self._history[-n:]

    def _reject(self, token: int) -> None:
        g = self.g
        allowed = (g.eos_ids if self._terminated else [g.coord_id, *g.eos_ids] if self._pos == 0
                   else [g.cycle[self._pos]])
        raise GrammarMatchError(f"{self.g.kind} grammar: token {token} is not allowed at object "
                                f"{self._objects + 1}, token {self._pos + 1}; expected one of {allowed}")


def _copy(src: np.ndarray, row: np.ndarray) -> None:
    n = min(row.shape[0], src.shape[0])
    row[:n] = src[:n]
    row[n:] = 0


def build_region(spec: GrammarSpec, tokenizer: Any, vocab_size: int, *, coord_id: int, size_id: int) -> RegionGrammar:
    eos = [int(i) for i in getattr(tokenizer, "eos_token_ids", ())]
    return RegionGrammar(spec.kind, spec.max_objects, coord_id, size_id, eos, vocab_size)


def region_factories(coord_id: int, size_id: int, kinds=REGION_KINDS) -> Mapping[str, Callable]:
    """Grammar factories that replace the text skills for a model with region heads (one per kind)."""
    return {k: partial(build_region, coord_id=coord_id, size_id=size_id) for k in kinds}


def tokens_per_object(kind: str) -> int:
    return 2 if kind == "point" else 3


def region_result(kind: str, carried: Mapping[int, list[float]] | None) -> dict[str, Any]:
    """The reference's result dict from the carried values, in output order: point (x, y) per object;
    detect (x, y, (w, h)) per object, as a box x ± w/2, y ± h/2 (unclamped, as the reference). An
    object cut short by max_tokens is dropped."""
    values = [v for _, v in sorted((carried or {}).items())]
    per = tokens_per_object(kind)
    groups = [values[i:i + per] for i in range(0, len(values) - per + 1, per)]
    if kind == "point":
        return {"points": [{"x": x[0], "y": y[0]} for x, y in groups]}
    return {"objects": [{"x_min": x[0] - wh[0] / 2, "y_min": y[0] - wh[1] / 2,
                         "x_max": x[0] + wh[0] / 2, "y_max": y[0] + wh[1] / 2} for x, y, wh in groups]}

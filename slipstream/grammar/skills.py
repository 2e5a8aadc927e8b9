"""Spatial skills (point, detect, segment) for text-only models: integers on lines, one object a line.

Every coordinate is an integer 0..1023 (no leading zeros) written with the model's own "0".."9"
tokens; values on a line are separated by one " " token and every line ends with one "\\n" token.
Nothing else may appear. EOS may only come where a line could begin, and once `max_objects` lines
are complete the output is finished. Layouts (V = a value):

    point     "X Y\\n" per object                      -> {"points": [{"x", "y"}]}
    detect    "CX CY W H\\n" per object (centre, size)  -> {"objects": [{"x_min", "y_min", "x_max", "y_max"}]}
    segment   "X0 Y0 X1 Y1\\n" (bbox) then "X Y\\n" per outline point (at least 3, at most max_objects)
              -> {"path": "M x,y L x,y ... Z", "bbox": {"x_min", "y_min", "x_max", "y_max"}}

Zero objects is always valid (EOS first). The allowed-token sets come from decoding the vocabulary
(see vocab.py), so any tokenizer with single-character digit, space and newline tokens works.
"""
from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from slipstream.errors import GrammarCompileError, GrammarError, GrammarMatchError
from slipstream.grammar.base import GrammarSpec
from slipstream.grammar.bitmask import set_allowed, words_for
from slipstream.grammar.vocab import token_table

MAX_VALUE = 1023  # coordinates are bins 0..1023; value / 1023 is the normalised position
SKILL_KINDS = ("point", "detect", "segment")
MIN_OUTLINE_POINTS = 3

_DIGIT, _SPACE, _NEWLINE, _EOS = 0, 1, 2, 3
_NO_VALUE = -1  # no digit of the current value yet


def _max_next_digit(value: int) -> int:
    """Largest digit that may follow `value` (-1: none), keeping it <= MAX_VALUE with no leading zero."""
    if value == _NO_VALUE:
        return 9
    if value == 0:
        return -1
    return max(-1, min(9, MAX_VALUE - 10 * value))


class SkillGrammar:
    """A compiled skill layout for one tokenizer; shared, immutable apart from its row cache."""

    def __init__(self, kind: str, max_objects: int, tokenizer: Any, vocab_size: int) -> None:
        if kind not in SKILL_KINDS:
            raise GrammarCompileError(f"unknown skill {kind!r} (expected one of {', '.join(SKILL_KINDS)})")
        self.kind = kind
        self.max_objects = max_objects
        table = token_table(tokenizer)
        self.words = words_for(vocab_size)
        limit = min(vocab_size, table.vocab_size)  # ids past either end can never be allowed

        def usable(text: str) -> list[int]:
            ids = [i for i in table.require(text, f"{kind} grammar") if i < limit]
            if not ids:
                raise GrammarCompileError(f"{kind} grammar: the token for {text!r} lies outside the logits")
            return ids

        self.eos_ids = [i for i in table.eos_ids if i < limit]
        if not self.eos_ids:
            raise GrammarCompileError(f"{kind} grammar: the tokenizer has no EOS token")
        self._classes: dict[int, tuple[int, int]] = {}
        self._digit_ids: list[list[int]] = []
        for d in range(10):
            ids = usable(str(d))
            self._digit_ids.append(ids)
            self._classes.update((i, (_DIGIT, d)) for i in ids)
        self._space_ids = usable(" ")
        self._newline_ids = usable("\n")
        self._classes.update((i, (_SPACE, 0)) for i in self._space_ids)
        self._classes.update((i, (_NEWLINE, 0)) for i in self._newline_ids)
        self._classes.update((i, (_EOS, 0)) for i in self.eos_ids)
        self._texts = table.texts
        # Layout: the first line may be a header (segment's bbox); the rest are object lines.
        if kind == "segment":
            self.header_fields, self.fields = 4, 2
            self.max_lines = 0 if max_objects == 0 else 1 + max_objects
            self.min_lines = 0 if max_objects == 0 else 1 + min(MIN_OUTLINE_POINTS, max_objects)
        else:
            self.header_fields, self.fields = 0, (2 if kind == "point" else 4)
            self.max_lines, self.min_lines = max_objects, 0
        # Every row a matcher can ask for, built here so the engine tick only copies (25 rows).
        self._rows: dict[tuple[int, int, bool], np.ndarray] = {}
        for key in [(9, None, False), (9, None, True), (-1, None, True)] + [
            (k, sep, False) for k in range(-1, 10) for sep in (_SPACE, _NEWLINE)
        ]:
            self.row(*key)

    def fields_in_line(self, line: int) -> int:
        return self.header_fields if line == 0 and self.header_fields else self.fields

    def eos_allowed(self, lines_done: int) -> bool:
        return lines_done == 0 or lines_done >= self.min_lines

    def row(self, max_digit: int, sep: int | None, eos: bool) -> np.ndarray:
        """The packed row allowing digits 0..max_digit, one separator class and maybe EOS (cached, read-only)."""
        key = (max_digit, -1 if sep is None else sep, eos)
        row = self._rows.get(key)
        if row is None:
            row = np.zeros(self.words, dtype=np.int32)
            for d in range(max_digit + 1):
                set_allowed(row, self._digit_ids[d])
            if sep == _SPACE:
                set_allowed(row, self._space_ids)
            elif sep == _NEWLINE:
                set_allowed(row, self._newline_ids)
            if eos:
                set_allowed(row, self.eos_ids)
            row.setflags(write=False)
            self._rows[key] = row
        return row

    def classify(self, token: int) -> tuple[int, int] | None:
        return self._classes.get(int(token))

    def token_text(self, token: int) -> str:
        return self._texts[token] if 0 <= token < len(self._texts) else "<out of vocabulary>"

    def matcher(self) -> SkillMatcher:
        return SkillMatcher(self)


class SkillMatcher:
    """Walks one sequence through a SkillGrammar; state is (line, field, value, terminated)."""

    depends_on_previous_token = True

    def __init__(self, grammar: SkillGrammar) -> None:
        self.g = grammar
        self._line, self._field, self._value = 0, 0, _NO_VALUE
        self._terminated = grammar.max_lines == 0
        self._history: list[tuple[int, int, int, bool]] = []

    def _state(self) -> tuple[int, int, int, bool]:
        return self._line, self._field, self._value, self._terminated

    def _at_line_start(self) -> bool:
        return self._field == 0 and self._value == _NO_VALUE

    def is_terminated(self) -> bool:
        return self._terminated

    def fill_bitmask(self, row: np.ndarray) -> None:
        g = self.g
        if self._terminated:
            src = g.row(-1, None, True)
        elif self._value == _NO_VALUE:
            src = g.row(9, None, self._at_line_start() and g.eos_allowed(self._line))
        else:
            last = self._field == g.fields_in_line(self._line) - 1
            src = g.row(_max_next_digit(self._value), _NEWLINE if last else _SPACE, False)
        n = min(row.shape[0], src.shape[0])
        row[:n] = src[:n]
        row[n:] = 0

    def accept(self, token: int) -> None:
        g = self.g
        cls = g.classify(token)
        before = self._state()
        line, field, value, term = before
        if cls is None:
            self._reject(token)
        kind, digit = cls
        if term:
            if kind != _EOS:
                self._reject(token)
        elif kind == _EOS:
            if not (self._at_line_start() and g.eos_allowed(line)):
                self._reject(token)
            term = True
        elif kind == _DIGIT:
            if digit > _max_next_digit(value):
                self._reject(token)
            value = digit if value == _NO_VALUE else 10 * value + digit
        else:
            last = field == g.fields_in_line(line) - 1
            if value == _NO_VALUE or (kind == _NEWLINE) != last:
                self._reject(token)
            value = _NO_VALUE
            if last:
                line, field = line + 1, 0
                term = line >= g.max_lines
            else:
                field += 1
        self._history.append(before)
        self._line, self._field, self._value, self._terminated = line, field, value, term

    def rollback(self, n: int) -> None:
        if n < 0 or n > len(self._history):
            raise GrammarMatchError(f"cannot roll back {n} tokens: only {len(self._history)} accepted")
        if n:
            self._line, self._field, self._value, self._terminated = self._history[-n]
            del self._history[-n:]

    def _reject(self, token: int) -> NoReturn:
        g = self.g
        if self._terminated:
            expected = "EOS (the output is complete)"
        elif self._value == _NO_VALUE:
            expected = "a digit" + (" or EOS" if self._at_line_start() and g.eos_allowed(self._line) else "")
        else:
            last = self._field == g.fields_in_line(self._line) - 1
            sep = "'\\n'" if last else "' '"
            expected = (f"a digit or {sep}" if _max_next_digit(self._value) >= 0 else sep)
        raise GrammarMatchError(
            f"{g.kind} grammar: token {int(token)} ({g.token_text(int(token))!r}) is not allowed "
            f"on line {self._line + 1}, value {self._field + 1}; expected {expected}"
        )


def build_skill(spec: GrammarSpec, tokenizer: Any, vocab_size: int) -> SkillGrammar:
    """Registry factory for the built-in skills."""
    return SkillGrammar(spec.kind, spec.max_objects, tokenizer, vocab_size)


# --- results -------------------------------------------------------------------------------


def _norm(v: int) -> float:
    return min(max(v / MAX_VALUE, 0.0), 1.0)


def _fmt(v: float) -> str:
    return f"{v:.4f}".rstrip("0").rstrip(".") or "0"


def _lines(kind: str, text: str) -> list[list[int]]:
    """Complete lines as integer lists; text after the last newline (a truncated line) is dropped."""
    out: list[list[int]] = []
    for n, line in enumerate(text.split("\n")[:-1], start=1):
        try:
            out.append([int(p) for p in line.split()])
        except ValueError:
            raise GrammarError(f"cannot parse {kind} output: line {n} {line!r} is not integers") from None
    return out


def _expect(kind: str, values: list[int], count: int, n: int) -> None:
    if len(values) != count:
        raise GrammarError(f"cannot parse {kind} output: line {n} has {len(values)} values, expected {count}")


def parse_skill_output(kind: str, text: str) -> dict[str, Any]:
    """The Moondream-style result dict of a skill's generated text; coordinates normalised to [0, 1]."""
    if kind not in SKILL_KINDS:
        raise GrammarError(f"unknown skill {kind!r} (expected one of {', '.join(SKILL_KINDS)})")
    lines = _lines(kind, text)
    if kind == "point":
        for n, vals in enumerate(lines, start=1):
            _expect(kind, vals, 2, n)
        return {"points": [{"x": _norm(x), "y": _norm(y)} for x, y in lines]}
    if kind == "detect":
        objects = []
        for n, vals in enumerate(lines, start=1):
            _expect(kind, vals, 4, n)
            cx, cy, w, h = (v / MAX_VALUE for v in vals)
            objects.append({"x_min": _clamp(cx - w / 2), "y_min": _clamp(cy - h / 2),
                            "x_max": _clamp(cx + w / 2), "y_max": _clamp(cy + h / 2)})
        return {"objects": objects}
    if kind == "segment":
        if not lines:
            return {"path": "", "bbox": None}
        _expect(kind, lines[0], 4, 1)
        x0, y0, x1, y1 = (_norm(v) for v in lines[0])
        bbox = {"x_min": min(x0, x1), "y_min": min(y0, y1), "x_max": max(x0, x1), "y_max": max(y0, y1)}
        points = []
        for n, vals in enumerate(lines[1:], start=2):
            _expect(kind, vals, 2, n)
            points.append(f"{_fmt(_norm(vals[0]))},{_fmt(_norm(vals[1]))}")
        path = ("M " + " L ".join(points) + " Z") if points else ""
        return {"path": path, "bbox": bbox}
    raise AssertionError(kind)


def _clamp(v: float) -> float:
    return min(max(v, 0.0), 1.0)

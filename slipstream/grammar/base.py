"""The grammar plugin interface: specs, compiled grammars and per-sequence matchers.

A `GrammarSpec` names what the output must look like. A `GrammarCompiler` (compiler.py, one per
engine) turns it into a `Grammar` once per spec, off the engine tick and under a timeout, and caches it. Each sequence
gets its own `Matcher` from the shared grammar; the engine asks it for a packed bitmask row before
sampling and tells it every committed token.

A grammar may also declare carry tokens (`carry_tokens`, optional): after the model samples one of
them, the next input is not that token but a value decoded from the model's hidden state by the
head of the named kind (docs/moondream.md, "The carry").

A matcher may also declare that its mask is a function of the output index only
(`mask_by_output_index`, optional; see `IndexMaskMatcher`): its rows are then sampled at launch,
behind the forward, even though it depends on the previous token.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np

from slipstream.errors import GrammarCompileError
from slipstream.models.carry_kind import CarryKind



class GrammarSpec(msgspec.Struct, frozen=True):
    """What a request's output must match; hashable, so it is the compile-cache key."""

    kind: str  # "json_schema" | "regex" | "choice" | "tool_calls" | "point" | "detect" | "segment" | a plugin name
    value: str = ""  # schema JSON text / regex / choice list as JSON text / object name for skills
    max_objects: int = 16


@runtime_checkable
class Matcher(Protocol):
    """Per-sequence state of one grammar. Called from the engine loop's thread only."""

    depends_on_previous_token: bool  # True: the mask for step t+1 needs token t committed

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed set for the next token into `row` (int32, words_for(V) words).

        Bit j of word i allows token 32*i + j. Must write only `row`, and must leave ids at or past
        the tokenizer's vocabulary (logits padding) at 0.
        """
        ...

    def accept(self, token: int) -> None:
        """Advance by one committed token; GrammarMatchError (state unchanged) if it is not allowed."""
        ...

    def is_terminated(self) -> bool:
        """True once the output is complete: nothing but EOS may follow (the engine stops with "stop")."""
        ...

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens; NotImplementedError if the matcher cannot."""
        ...


class IndexMaskMatcher(Matcher, Protocol):
    """Optional capability: the allowed set at output index i is a function of i alone, given that
    every earlier output was accepted and that the request ends at the token completing the grammar
    (Moondream's region grammar: which token of which object i is). The engine then builds the mask at
    launch for the row's upcoming index instead of waiting for the previous token's commit; `accept`
    still checks every committed token, so a wrong token still fails the request. A request the tick
    does not end at the grammar's completion (stop strings) keeps the late path (`fill_bitmask`)."""

    mask_by_output_index: bool  # True: `mask_for_output_index` may be used instead of waiting

    def mask_for_output_index(self, index: int, row: np.ndarray) -> None:
        """Write the allowed set for output token `index` (0 = the first output token) into `row`, with
        `fill_bitmask`'s rules. Must not read or change the accepted state."""
        ...


def masks_by_output_index(matcher: Any) -> bool:
    """Whether `matcher` declares the optional IndexMaskMatcher capability."""
    return bool(getattr(matcher, "mask_by_output_index", False)) and callable(
        getattr(matcher, "mask_for_output_index", None))


@runtime_checkable
class Grammar(Protocol):
    """A compiled grammar, built once per (spec, tokenizer) and shared by all sequences using it.

    Optional attribute `carry_tokens: Mapping[int, CarryKind]`: token id -> the kind of head value
    (name, number of values) the model's next input is after that token is sampled. Absent or
    empty: every input is a token."""

    def matcher(self) -> Matcher:
        ...


def carry_tokens(grammar: Any, name: str = "grammar") -> dict[int, CarryKind]:
    """The grammar's carry tokens, checked (GrammarCompileError naming `name` for a bad declaration)."""
    declared = getattr(grammar, "carry_tokens", None)
    if not declared:
        return {}
    if not isinstance(declared, Mapping):
        raise GrammarCompileError(f"{name}: carry_tokens must map token ids to CarryKind, got "
                                  f"{type(declared).__name__}")
    out: dict[int, CarryKind] = {}
    for token, kind in declared.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise GrammarCompileError(f"{name}: carry token {token!r} is not a token id")
        if not (isinstance(kind, tuple) and len(kind) == 2 and isinstance(kind[0], str)
                and isinstance(kind[1], int) and not isinstance(kind[1], bool) and kind[1] > 0):
            raise GrammarCompileError(f"{name}: carry token {token} maps to {kind!r}, not a CarryKind(name, values > 0)")
        out[token] = CarryKind(*kind)
    return out


def resolve_carry(declared: Mapping[int, CarryKind], model_kinds: Sequence[CarryKind], max_tokens: int,
                  name: str = "grammar") -> tuple[tuple[int, int], ...]:
    """(token id, the model's kind number) per carry token, or GrammarCompileError when the model has
    no head of that name, its head has another number of values, or there are too many tokens."""
    if len(declared) > max_tokens:
        raise GrammarCompileError(f"{name} declares {len(declared)} carry tokens; at most {max_tokens} are supported")
    numbers = {k.name: (i, k.values) for i, k in enumerate(model_kinds, start=1)}
    out = []
    for token, kind in sorted(declared.items()):
        if kind.name not in numbers:
            have = ", ".join(numbers) or "none"
            raise GrammarCompileError(f"{name}: carry token {token} needs a {kind.name!r} head, which the model "
                                      f"lacks (its carry heads: {have})")
        number, values = numbers[kind.name]
        if values != kind.values:
            raise GrammarCompileError(f"{name}: carry kind {kind.name!r} has {kind.values} values in the grammar "
                                      f"but {values} in the model")
        out.append((token, number))
    return tuple(out)

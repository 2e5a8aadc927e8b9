"""The grammar plugin interface: specs, compiled grammars and per-sequence matchers.

A `GrammarSpec` names what the output must look like. A `GrammarCompiler` (compiler.py, one per
engine) turns it into a `Grammar` once per spec, off the engine tick and under a timeout, and caches it. Each sequence
gets its own `Matcher` from the shared grammar; the engine asks it for a packed bitmask row before
sampling and tells it every committed token.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np



class GrammarSpec(msgspec.Struct, frozen=True):
    """What a request's output must match; hashable, so it is the compile-cache key."""

    kind: str  # "json_schema" | "regex" | "choice" | "point" | "detect" | "segment" | a plugin name
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


@runtime_checkable
class Grammar(Protocol):
    """A compiled grammar, built once per (spec, tokenizer) and shared by all sequences using it."""

    def matcher(self) -> Matcher:
        ...

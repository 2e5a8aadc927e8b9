"""Example grammar plugin: the output may only use characters from `spec.value`, then EOS.

    GrammarSpec(kind="charset", value="ACGT")

allows every token whose text is made only of A, C, G and T, and EOS at any point. The allowed set
is the same at every step, so `depends_on_previous_token` is False: the engine may build this row's
mask before the previous token is committed and sample it straight after the forward pass.
"""
from __future__ import annotations

import numpy as np

from slipstream.errors import GrammarCompileError, GrammarMatchError
from slipstream.grammar import GrammarSpec, set_allowed, token_table, words_for


class CharsetGrammar:
    """Compiled once per (spec, tokenizer) and shared by every sequence that uses it."""

    def __init__(self, spec: GrammarSpec, tokenizer, vocab_size: int) -> None:
        chars = set(spec.value)
        if not chars:
            raise GrammarCompileError("charset grammar: value must list the allowed characters")
        table = token_table(tokenizer)  # decoded text of every id, cached per tokenizer
        limit = min(vocab_size, table.vocab_size)  # never allow logits padding columns
        self.text_ids = frozenset(i for i, t in enumerate(table.texts[:limit]) if t and set(t) <= chars)
        if not self.text_ids:
            raise GrammarCompileError(f"charset grammar: no token spells only {''.join(sorted(chars))!r}")
        self.eos_ids = frozenset(i for i in table.eos_ids if i < limit)
        self.row = np.zeros(words_for(vocab_size), dtype=np.int32)  # the one mask, built once
        set_allowed(self.row, self.text_ids | self.eos_ids)

    def matcher(self) -> CharsetMatcher:
        return CharsetMatcher(self)


class CharsetMatcher:
    """Per-sequence state: only whether EOS has been accepted."""

    depends_on_previous_token = False

    def __init__(self, grammar: CharsetGrammar) -> None:
        self.g = grammar
        self.ended = False

    def fill_bitmask(self, row: np.ndarray) -> None:
        row[:] = self.g.row

    def accept(self, token: int) -> None:
        if token in self.g.eos_ids:
            self.ended = True
        elif self.ended or token not in self.g.text_ids:
            raise GrammarMatchError(f"charset grammar: token {token} is not allowed")

    def is_terminated(self) -> bool:
        return self.ended

    def rollback(self, n: int) -> None:
        raise NotImplementedError("the charset example does not roll back")


def build(spec: GrammarSpec, tokenizer, vocab_size: int) -> CharsetGrammar:
    """The factory the entry point names: (spec, tokenizer, vocab_size) -> Grammar."""
    return CharsetGrammar(spec, tokenizer, vocab_size)

"""The carry without Moondream: a test-only head for the tiny Llama and a tiny grammar plugin that
declares carry tokens (docs/moondream.md, "The carry", shows both).

`DemoHeads` has two kinds, "coordinate" (1 value) and "size" (2 values). A value is a bin of the
hidden state (an argmax over a slice, / 32), so it is exact in float32 and depends on everything the
row has seen; its encoding is the values times a fixed random matrix, large enough that feeding the
token's embedding instead (or a value one step late) changes the values decoded afterwards.

`CarryDemoGrammar` ("carry_demo", value = how many carry tokens): exactly that many carry tokens,
cycling coordinate, coordinate, size (detect's x, y, size), then free text until max_tokens.
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.grammar import CarryKind, register_grammar, unregister_grammar
from slipstream.grammar.bitmask import set_allowed, words_for

COORD_TOKEN, SIZE_TOKEN = 70, 71  # ids of the tiny byte tokenizer ("C", "D")
KINDS = (CarryKind("coordinate", 1), CarryKind("size", 2))
BINS = 32


class DemoHeads:
    kinds = KINDS

    def __init__(self, hidden_size: int, dtype=torch.float32, device="cpu", seed: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.enc = [(torch.randn(k.values, hidden_size, generator=g) * 3).to(dtype=dtype, device=device)
                    for k in KINDS]
        self.decoded = 0  # rows decoded (tests: the heads ran)

    def decode(self, kind: int, hidden: torch.Tensor) -> torch.Tensor:
        self.decoded += hidden.shape[0]
        h = hidden.float()
        parts = [h[:, i * BINS:(i + 1) * BINS].argmax(-1) for i in range(KINDS[kind - 1].values)]
        offset = 0 if kind == 1 else 1
        return (torch.stack(parts, dim=1).float() + offset) / BINS

    def encode(self, kind: int, values: torch.Tensor) -> torch.Tensor:
        return values.to(self.enc[kind - 1].dtype) @ self.enc[kind - 1]


def install_heads(runner) -> DemoHeads:
    model = runner.model
    weight = model.model.embed_tokens.weight
    model.carry_heads = heads = DemoHeads(model.config.hidden_size, weight.dtype, weight.device)
    return heads


CYCLE = (COORD_TOKEN, COORD_TOKEN, SIZE_TOKEN)


class CarryDemoGrammar:
    """Only the next carry token while carry tokens are due, then anything below `vocab`."""

    carry_tokens = {COORD_TOKEN: KINDS[0], SIZE_TOKEN: KINDS[1]}

    def __init__(self, spec, tokenizer, vocab_size):
        self.count = int(spec.value)
        words = words_for(vocab_size)
        self.rows = {}
        for t in set(CYCLE):
            self.rows[t] = np.zeros(words, np.int32)
            set_allowed(self.rows[t], [t])
        self.free = np.zeros(words, np.int32)
        set_allowed(self.free, range(3, min(vocab_size, getattr(tokenizer, "vocab_size", vocab_size))))

    def matcher(self):
        return CarryDemoMatcher(self)


class CarryDemoMatcher:
    depends_on_previous_token = True

    def __init__(self, g: CarryDemoGrammar):
        self.g, self.n = g, 0

    def fill_bitmask(self, row):
        row[:] = self.g.rows[CYCLE[self.n % 3]] if self.n < self.g.count else self.g.free

    def accept(self, token):
        self.n += 1

    def is_terminated(self):
        return False

    def rollback(self, n):
        self.n -= n


def expected_kinds(count: int) -> list[int]:
    return [1 if CYCLE[i % 3] == COORD_TOKEN else 2 for i in range(count)]


class registered:
    """`with registered():` the carry_demo plugin for the block."""

    def __enter__(self):
        register_grammar("carry_demo", CarryDemoGrammar, replace=True)

    def __exit__(self, *exc):
        unregister_grammar("carry_demo")

"""The llguidance calls speculation's grammar rows rely on (docs/speculative.md, "Grammars"), on the
installed version: drafts are validated without moving the matcher, masks for the current state and
after each valid draft come in one call that leaves the state as it was, and they equal consuming
the drafts one by one and rolling back."""
from __future__ import annotations

import numpy as np
import pytest

from slipstream.grammar import GrammarCompiler, GrammarSpec, allowed_ids, words_for
from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer

llguidance = pytest.importorskip("llguidance")
lln = pytest.importorskip("llguidance.numpy")

BT = ByteTokenizer()
V = 512


def test_drafts_validate_and_mask_without_moving_the_matcher():
    m = GrammarCompiler(BT, V).compile(GrammarSpec("regex", "ab(c|d)ef")).matcher()._m
    drafts = BT.encode("abcxf")  # the grammar allows "abc", not "x"
    assert m.validate_tokens(drafts) == 3
    assert m.validate_tokens(drafts) == 3  # (validating moved nothing)
    masks = np.full((len(drafts) + 1, words_for(V)), -1, dtype=np.int32)  # rows it does not reach: all allowed
    lln.fill_next_token_bitmask_par_with_draft_tokens(llguidance.LLExecutor(1), [(m, 0, drafts)], masks)
    assert [BT.decode(allowed_ids(masks[j], V)) for j in range(4)] == ["a", "b", "cd", "e"]
    assert (masks[4:] == -1).all()
    assert m.validate_tokens(drafts) == 3  # the state is back where it was
    for j in range(4):  # the same as consuming each draft, then rolling back
        row = np.zeros(words_for(V), np.int32)
        m.unsafe_compute_mask_ptr(row.ctypes.data, 4 * len(row))
        assert (row == masks[j]).all()
        if j < 3:
            assert m.try_consume_tokens([drafts[j]]) == 1
    assert m.rollback(3)
    assert m.validate_tokens(drafts) == 3

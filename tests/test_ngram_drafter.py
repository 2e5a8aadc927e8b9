"""Prompt-lookup drafting on the device (slipstream/speculation/ngram_drafter.py) against a plain-Python
reference, the token history it reads, and the drafter plugin point."""
from __future__ import annotations

import random

import pytest
import torch

from slipstream.speculation.registry import build_drafter, register_drafter
from slipstream.speculation.ngram_drafter import NgramDrafter
from slipstream.speculation.history import NO_TOKEN, TokenHistory


def reference(seq: list[int], k: int, min_n: int, max_n: int, window: int) -> list[int] | None:
    """The drafts for `seq` by the rule in the module's docstring, one row, in plain Python."""
    w = seq[-window:]
    for n in range(max_n, min_n - 1, -1):
        if len(w) <= n:
            continue
        for c in range(len(w) - 1, n - 1, -1):  # latest first
            if w[c - n:c] == w[len(w) - n:]:
                p = len(w) - c
                return [w[c + j % p] for j in range(k)]
    return None


def reference_n(seq: list[int], min_n: int, max_n: int, window: int) -> int:
    """The matched length the rule finds (its proposal's strength), 0: none."""
    w = seq[-window:]
    for n in range(max_n, min_n - 1, -1):
        if len(w) > n and any(w[c - n:c] == w[len(w) - n:] for c in range(n, len(w))):
            return n
    return 0


def loaded(seqs: list[list[int]], max_len: int = 64) -> TokenHistory:
    h = TokenHistory(len(seqs) + 1, max_len)
    for row, seq in enumerate(seqs, start=1):
        t = torch.tensor(seq, dtype=torch.int64)
        h.write_chunks(torch.full_like(t, row), torch.arange(len(seq)), t, torch.tensor([row]),
                       torch.tensor([len(seq)]))
    return h


def test_drafts_follow_the_latest_longest_match():
    seqs = [[5, 6, 7, 8, 1, 5, 6, 7, 2, 5, 6, 7],  # "5 6 7" seen twice: the latest (then 2) wins
            [1, 2, 3, 4, 9, 9, 2, 3],  # only "2 3" matches: 4 9 9 2
            [7, 7, 7, 7],  # period 1
            [1, 2, 1, 2, 1],  # period 2 runs into the present: 2 1 2 1
            [3, 4, 5]]  # no match
    d = NgramDrafter(loaded(seqs), max_drafts=4, min_n=1, max_n=3, window=16).propose(torch.arange(1, 6))
    assert d.tokens[:4].tolist() == [[2, 5, 6, 7], [4, 9, 9, 2], [7, 7, 7, 7], [2, 1, 2, 1]]
    assert d.matched.tolist() == [True, True, True, True, False]
    assert d.tokens[4].tolist() == [5, 5, 5, 5]  # filler: the newest token


@pytest.mark.parametrize("path", ["_propose_numpy", "_propose_torch"])  # (the CPU's, and any other device's)
@pytest.mark.parametrize("min_n,max_n,window", [(1, 3, 12), (2, 4, 40), (1, 1, 5)])
def test_matches_the_reference_on_random_sequences(min_n, max_n, window, path):
    rng = random.Random(min_n * 100 + window)
    seqs = [[rng.randrange(4) for _ in range(rng.randrange(1, 50))] for _ in range(40)]
    d = NgramDrafter(loaded(seqs), max_drafts=5, min_n=min_n, max_n=max_n, window=window)
    rows = torch.arange(1, len(seqs) + 1)[torch.randperm(len(seqs), generator=torch.Generator().manual_seed(window))]
    out = getattr(d, path)(rows)  # (rows in any order)
    for i, row in enumerate(rows.tolist()):
        seq = seqs[row - 1]
        want, n = reference(seq, 5, min_n, max_n, window), reference_n(seq, min_n, max_n, window)
        assert out.matched[i].item() == (want is not None), seq
        assert out.strength[i].item() == n, seq
        if want is not None:
            assert out.tokens[i].tolist() == want, seq
        else:
            assert out.tokens[i].tolist() == [seq[-1]] * 5  # filler: the newest token


def test_history_appends_emitted_tokens_and_recompute_restarts_it():
    h = loaded([[1, 2, 3], [4]], max_len=6)
    h.append(torch.tensor([1, 2]), torch.tensor([[9, 8, 7], [5, NO_TOKEN, NO_TOKEN]]), torch.tensor([2, 1]))
    assert h.length[1:3].tolist() == [5, 2]
    assert h.window(torch.tensor([1, 2]), 6).tolist() == [[-1, 1, 2, 3, 9, 8], [-1, -1, -1, -1, 4, 5]]
    h.append(torch.tensor([1]), torch.tensor([[6, 7, 8]]), torch.tensor([3]))  # past max_len: kept out
    assert h.length[1].item() == 6 and h.tokens[1, :6].tolist() == [1, 2, 3, 9, 8, 6]
    t = torch.tensor([1, 2])
    h.write_chunks(torch.tensor([1, 1]), torch.arange(2), t, torch.tensor([1]), torch.tensor([2]))
    assert h.window(torch.tensor([1]), 3).tolist() == [[-1, 1, 2]]


def test_plugin_point_builds_registered_drafters():
    history = TokenHistory(2, 8)
    assert isinstance(build_drafter("ngram", history=history, max_drafts=3), NgramDrafter)
    register_drafter("test-const", lambda history, max_drafts: ("const", max_drafts), replace=True)
    assert build_drafter("test-const", history=history, max_drafts=2) == ("const", 2)
    with pytest.raises(ValueError, match="built-in"):
        register_drafter("ngram", NgramDrafter)
    with pytest.raises(ValueError, match="unknown drafter 'nope'"):
        build_drafter("nope", history=history, max_drafts=2)


def test_the_host_proposal_of_shadow_probes_is_the_device_rule():
    """NgramDrafter.propose_tokens (what the policy's shadow probes score) gives the first draft and
    the matched length that the device's proposal gives for the same tokens, and the reference's."""
    rng = random.Random(3)
    seqs = [[rng.randrange(3, 9) for _ in range(rng.randint(1, 40))] for _ in range(60)]
    seqs += [[4], [5, 5], [1, 2, 3, 1, 2]]
    for window in (8, 64):
        drafter = NgramDrafter(loaded(seqs), max_drafts=3, min_n=1, max_n=3, window=window)
        device = drafter.propose(torch.arange(1, len(seqs) + 1))
        for i, seq in enumerate(seqs):
            first, strength = drafter.propose_tokens(seq)
            assert (first, strength) == (int(device.tokens[i, 0]), int(device.strength[i])), (seq, window)
            ref = reference(seq, 3, 1, 3, window)
            assert strength == reference_n(seq, 1, 3, window) and (ref is None or first == ref[0])

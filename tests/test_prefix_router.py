"""The prefix-aware routing policy on its own (no Ray): block-hash chains, the prefix table, the choice."""
import random

import pytest

from slipstream.serve.prefix_router import PrefixTable, block_hashes, choose


def test_chain_covers_full_blocks_and_the_whole_prefix():
    a = list(range(40))
    assert len(block_hashes(a, 8)) == 5 and len(block_hashes(a[:39], 8)) == 4  # a partial block has no hash
    b = a[:20] + [999] + a[21:]  # differs inside block 2
    ha, hb = block_hashes(a, 8), block_hashes(b, 8)
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:]))  # chained: every later block differs
    # the same block after a different prefix hashes differently (a page is keyed by its whole prefix)
    assert block_hashes([1] * 8 + [2] * 8, 8)[1] != block_hashes([3] * 8 + [2] * 8, 8)[1]
    assert block_hashes(a, 8) == block_hashes(list(a), 8)  # deterministic (across processes too: blake2b)
    with pytest.raises(ValueError, match="page_size"):
        block_hashes(a, 0)


def test_table_longest_live_match_lru_and_forget():
    t = PrefixTable(capacity=6)
    h = block_hashes(list(range(48)), 8)  # 6 blocks
    t.record(h[:2], "r1")
    t.record(h[:4], "r2")  # r2 served a longer prompt with the same start: the blocks are r2's now
    assert t.longest_match(h, {"r1", "r2"}) == ("r2", 4)
    assert t.longest_match(h, {"r1"}) == (None, 0)  # r2's blocks do not count for r1 when r2 is gone
    assert t.longest_match(block_hashes([7] * 16, 8), {"r1", "r2"}) == (None, 0)
    t.record(block_hashes([5] * 24, 8), "r1")  # 3 more entries: the 1 least recently used falls out
    assert len(t) == 6 and t.longest_match(h, {"r2"}) == (None, 0)  # h[0] was the oldest
    assert t.forget("r2") == 3 and t.owners() == {"r1"}


def _choose(hashes, queues, table, threshold=4, seed=0):
    return choose(hashes, list(queues), queues.get, table, key=lambda r: r, imbalance_threshold=threshold,
                  rng=random.Random(seed))


def test_choice_prefers_the_prefix_owner_then_balances():
    t = PrefixTable()
    h = block_hashes(list(range(32)), 8)
    t.record(h, "b")
    got = _choose(h, {"a": 0, "b": 3, "c": 1}, t)
    assert got.reason == "prefix" and got.ranks[0] == ["b"] and sorted(got.ranks[1]) == ["a", "c"]
    assert got.matched_blocks == 4
    # the owner is 5 requests deeper than the idlest replica (> threshold 4): balance wins
    got = _choose(h, {"a": 0, "b": 5}, t)
    assert got.reason == "balance" and got.ranks == [["a", "b"]]
    # no prefix anywhere: power of two choices, the shorter queue first
    got = _choose(block_hashes([9] * 16, 8), {"a": 2, "b": 0}, t)
    assert got.reason == "no_match" and got.ranks == [["b", "a"]]


def test_two_choices_samples_two_of_many_and_spreads_unknown_queues():
    t = PrefixTable()
    seen = set()
    for seed in range(40):
        got = _choose([], {f"r{i}": None for i in range(5)}, t, seed=seed)
        assert len(got.ranks) == 1 and len(got.ranks[0]) == 2
        seen.add(got.ranks[0][0])
    assert len(seen) >= 3  # unknown queue lengths: not always the first candidate
    assert _choose([], {}, t).ranks == []

"""Draft verification on the device (slipstream/speculation/verify.py).

Replay acceptance must emit exactly what non-speculative decoding emits from the same logits, token
for token (greedy, seeded sampling, penalties, min_tokens, masks), whatever the drafts; rejection
sampling must leave the distribution of the output the target's (chi-square over 12,000 draws).
The "model" is a Markov table: the logits of a position depend on its input token only.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from slipstream.grammar.bitmask import allocate_bitmask, set_allowed
from slipstream.runtime.sampling.logits_process import record_sampled
from slipstream.runtime.sampling.sampler import sample_group
from slipstream.runtime.sampling.sampling_args import Draw, Penalties, SamplingArgs, TopKTopP
from slipstream.speculation.verify import (NO_TOKEN, _replay_accept_numpy, _replay_accept_torch, count_emitted,
                                           rejection_accept, replay_accept, spec_layout, target_tokens, verify_inputs)

V = 12


def make_args(n: int, out: torch.Tensor, kind: str, seed0: int = 0) -> SamplingArgs:
    seed = torch.arange(seed0, seed0 + n, dtype=torch.int64)
    if kind == "greedy":
        return SamplingArgs(out)
    temperature = torch.full((n,), 0.8)
    temperature[::3] = 0.0  # greedy rows beside random ones
    filt = TopKTopP(torch.full((n,), 6, dtype=torch.int64), torch.full((n,), 0.95)) if kind == "filtered" else None
    args = SamplingArgs(out, draw=Draw(temperature, seed, filt))
    if kind == "penalised":  # penalties, min_tokens and min_p: every kernel that reads the history
        pen = Penalties(torch.full((n,), 0.3), torch.full((n,), 0.2), torch.full((n,), 1.3))
        args = SamplingArgs(out, draw=args.draw, penalties=pen, min_tokens=torch.full((n,), 5, dtype=torch.int64),
                            min_p=torch.full((n,), 0.05))
    return args


def index_masks(count: int, seed: int) -> torch.Tensor:
    """A random allowed set per output index (what an IndexMaskMatcher would give), never empty."""
    rs = np.random.RandomState(seed)
    masks = allocate_bitmask(count, V)
    for i in range(count):
        set_allowed(masks[i], rs.choice(V, size=rs.randint(2, V), replace=False).tolist())
    return torch.from_numpy(masks)


class Rows:
    """n sequences' device state: last token, output index, output counts; the prompt and stop masks."""

    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.last = torch.randint(0, V, (n,), generator=g)
        self.out = torch.zeros(n, dtype=torch.int64)
        self.counts = torch.zeros(n, V, dtype=torch.int32)
        self.prompt = torch.rand(n, V, generator=g) < 0.3
        self.stop = torch.zeros(n, V, dtype=torch.bool)
        self.stop[:, 0] = True  # token 0 plays EOS for min_tokens
        self.emitted: list[list[int]] = [[] for _ in range(n)]

    def history(self):
        return self.counts, self.prompt, self.stop


def reference(table, n, steps, kind, masks, seed) -> list[list[int]]:
    """Non-speculative decoding: one token per row per step."""
    r = Rows(n, seed)
    for _ in range(steps):
        args = make_args(n, r.out.clone(), kind)
        ids = sample_group(table[r.last], args, r.history() if args.needs_history else None,
                           None if masks is None else masks[r.out])
        record_sampled(r.counts, torch.arange(n), ids)
        for i, t in enumerate(ids.tolist()):
            r.emitted[i].append(t)
        r.out += 1
        r.last = ids
    return r.emitted


def speculate(table, n, steps, kind, masks, seed, truth, max_drafts=4, wrong=0.3) -> list[list[int]]:
    """Speculative decoding with replay: drafts copy the reference with some tokens wrong."""
    r, rs = Rows(n, seed), np.random.RandomState(seed + 1)
    rows = torch.arange(n)
    while min(len(e) for e in r.emitted) < steps:
        k = rs.randint(0, max_drafts + 1, n)
        drafts = torch.full((n, max_drafts), NO_TOKEN, dtype=torch.int64)
        for i in range(n):
            at = len(r.emitted[i])
            for j in range(k[i]):
                good = at + j < len(truth[i]) and rs.rand() > wrong
                drafts[i, j] = truth[i][at + j] if good else rs.randint(V)
        lay = spec_layout(k, max_drafts=max_drafts)
        args = make_args(n, r.out.clone(), kind)
        pos_out = r.out[lay.owner] + lay.offset
        targets = target_tokens(table[verify_inputs(r.last, drafts, lay)], args, drafts, lay,
                                r.history() if args.needs_history else None,
                                None if masks is None else masks[pos_out])
        v = replay_accept(targets, drafts, lay)
        count_emitted(r.counts, rows, v.tokens)
        for i, toks in enumerate(v.tokens.tolist()):
            r.emitted[i] += [t for t in toks if t != NO_TOKEN]
        r.out += v.accepted + 1
        r.last = v.last
    return [e[:steps] for e in r.emitted]


def test_layout_and_inputs():
    lay = spec_layout([2, 0, 3], max_drafts=3)
    assert lay.owner.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    assert lay.offset.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    assert lay.start.tolist() == [0, 3, 4]
    drafts = torch.tensor([[5, 6, -1], [-1, -1, -1], [7, 8, 9]])
    assert verify_inputs(torch.tensor([1, 2, 3]), drafts, lay).tolist() == [1, 5, 6, 2, 3, 7, 8, 9]
    with pytest.raises(ValueError, match="max_drafts"):
        spec_layout([4], max_drafts=3)


@pytest.mark.parametrize("kind", ["greedy", "random", "filtered", "penalised"])
@pytest.mark.parametrize("masked", [False, True])
def test_replay_emits_what_decoding_one_token_at_a_time_emits(kind, masked):
    n, steps = 16, 24
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(3)) * 2
    masks = index_masks(steps + 16, 5) if masked else None  # (rows run up to K past steps)
    truth = reference(table, n, steps, kind, masks, seed=11)
    assert speculate(table, n, steps, kind, masks, seed=11, truth=truth) == truth
    # drafts that are always right are all accepted, and still nothing changes
    assert speculate(table, n, steps, kind, masks, seed=11, truth=truth, wrong=0.0) == truth


@pytest.mark.parametrize("accept", [_replay_accept_numpy, _replay_accept_torch])  # (the CPU's, any other device's)
def test_replay_accepts_the_longest_matching_prefix(accept):
    lay = spec_layout([3, 3, 0, 2], max_drafts=3)
    drafts = torch.tensor([[4, 5, 6], [4, 9, 6], [-1, -1, -1], [1, 2, -1]])
    targets = torch.tensor([4, 5, 6, 7, 4, 5, 6, 7, 3, 1, 2, 8])
    v = accept(targets, drafts, lay)
    assert v.accepted.tolist() == [3, 1, 0, 2]
    assert v.tokens.tolist() == [[4, 5, 6, 7], [4, 5, -1, -1], [3, -1, -1, -1], [1, 2, 8, -1]]
    assert v.last.tolist() == [7, 5, 3, 8]


def test_replay_in_numpy_equals_replay_in_torch():
    rs = np.random.RandomState(5)
    for _ in range(200):
        n, width = rs.randint(1, 6), rs.randint(1, 6)
        k = rs.randint(0, width + 1, n)
        lay = spec_layout(k, max_drafts=width)
        targets = torch.from_numpy(rs.randint(0, 3, int(k.sum()) + n))
        drafts = torch.from_numpy(rs.randint(0, 3, (n, width)))  # (past k too: a drafter proposes max_drafts)
        a, b = _replay_accept_numpy(targets, drafts, lay), _replay_accept_torch(targets, drafts, lay)
        assert all(torch.equal(x, y) for x, y in zip(a, b))



def test_count_emitted_skips_padding():
    counts = torch.zeros(3, 5, dtype=torch.int32)
    count_emitted(counts, torch.tensor([2, 0]), torch.tensor([[1, 1, 4], [3, -1, -1]]))
    assert counts.tolist() == [[0, 0, 0, 1, 0], [0] * 5, [0, 2, 0, 0, 1]]


# --- distribution: chi-square over 12,000 rows, each its own seed --------------------------------

def chi_square_p(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Upper tail of Pearson's statistic (cells with expected count < 5 pooled)."""
    total = observed.sum()
    exp = expected_probs * total
    small = exp < 5
    obs_cells = np.append(observed[~small], observed[small].sum())
    exp_cells = np.append(exp[~small], exp[small].sum())
    if exp_cells[-1] == 0:
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    stat = ((obs_cells - exp_cells) ** 2 / exp_cells).sum()
    df = len(exp_cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


W, N, K = 5, 12_000, 3


def target_probs(table: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    x = table / temperature
    if top_k:
        x = x.masked_fill(x < x.topk(top_k, -1).values[:, -1:], float("-inf"))
    return x.softmax(-1)


def two_tokens(table, q_table, rule, temperature, top_k) -> np.ndarray:
    """Rounds of drafting (K drafts from q) and verification until every row emitted two tokens;
    counts of (first, second) emitted token."""
    g = torch.Generator().manual_seed(17)
    rows = torch.arange(N)
    last = torch.zeros(N, dtype=torch.int64)
    out = torch.zeros(N, dtype=torch.int64)
    seeds = torch.arange(N, dtype=torch.int64) * 7919
    emitted = torch.full((N, 2 + K + 1), NO_TOKEN, dtype=torch.int64)
    have = torch.zeros(N, dtype=torch.int64)
    lay = spec_layout(np.full(N, K))
    for _ in range(2):
        drafts, probs, prev = [], [], last
        for _ in range(K):  # the draft chain, from the draft model q
            q = q_table[prev]
            d = torch.multinomial(q, 1, generator=g)[:, 0]
            drafts.append(d)
            probs.append(q)
            prev = d
        drafts_t, probs_t = torch.stack(drafts, 1), torch.stack(probs, 1)
        logits = table[verify_inputs(last, drafts_t, lay)]
        filt = TopKTopP(torch.full((N,), top_k, dtype=torch.int64), torch.ones(N)) if top_k else None
        args = SamplingArgs(out.clone(), draw=Draw(torch.full((N,), temperature), seeds, filt))
        if rule == "replay":
            v = replay_accept(target_tokens(logits, args, drafts_t, lay), drafts_t, lay)
        else:  # "point": the drafts taken as point drafts, whatever drew them
            v = rejection_accept(logits, args, drafts_t, probs_t if rule == "rejection" else None, lay)
        count = v.accepted + 1
        cols = have[:, None] + torch.arange(K + 1)[None, :]
        write = (torch.arange(K + 1)[None, :] < count[:, None]) & (cols < emitted.shape[1])
        emitted[rows[:, None].expand_as(cols)[write], cols[write]] = v.tokens[write]
        have += count
        out += count
        last = v.last
    pairs = (emitted[:, 0] * W + emitted[:, 1]).numpy()
    return np.bincount(pairs, minlength=W * W)


@pytest.mark.parametrize("rule,temperature,top_k", [("replay", 1.0, 0), ("rejection", 0.7, 3), ("point", 1.0, 0)])
def test_output_distribution_is_the_targets(rule, temperature, top_k):
    gen = torch.Generator().manual_seed(23)
    table = torch.randn(W, W, generator=gen) * 1.5
    q_table = (torch.randn(W, W, generator=gen) * 1.5).softmax(-1)  # a draft model that disagrees often
    p = target_probs(table, temperature, top_k)
    expected = (p[0][:, None] * p).reshape(-1).numpy()  # P(e1) P(e2 | e1), from input token 0
    observed = two_tokens(table, q_table, rule, temperature, top_k)
    assert observed.sum() == N
    assert chi_square_p(observed, expected) > 1e-3


def test_rejection_accepts_as_often_as_one_minus_total_variation():
    gen = torch.Generator().manual_seed(29)
    p_logits, q = torch.randn(W, generator=gen), torch.randn(W, generator=gen).softmax(-1)
    lay = spec_layout(np.ones(N, np.int64))
    drafts = torch.multinomial(q.expand(N, W), 1, replacement=True, generator=gen)
    args = SamplingArgs(torch.zeros(N, dtype=torch.int64),
                        draw=Draw(torch.ones(N), torch.arange(N, dtype=torch.int64), None))
    v = rejection_accept(p_logits.expand(2 * N, W), args, drafts, q.expand(N, 1, W), lay)
    tv = 0.5 * (p_logits.softmax(-1) - q).abs().sum().item()
    assert abs(v.accepted.float().mean().item() - (1 - tv)) < 0.015


def test_rejection_on_greedy_rows_is_argmax_matching():
    lay = spec_layout([2, 2])
    table = torch.randn(W, W, generator=torch.Generator().manual_seed(31))
    greedy_next = table.argmax(-1)
    first = greedy_next[1].item()
    drafts = torch.tensor([[first, greedy_next[first].item()], [first, (greedy_next[first].item() + 1) % W]])
    logits = table[verify_inputs(torch.tensor([1, 1]), drafts, lay)]
    uniform_q = torch.full((2, 2, W), 1 / W)
    v = rejection_accept(logits, SamplingArgs(torch.zeros(2, dtype=torch.int64)), drafts, uniform_q, lay)
    assert v.accepted.tolist() == [2, 1]
    assert v.last.tolist() == [greedy_next[drafts[0, 1]].item(), greedy_next[first].item()]


def test_rejection_without_drafts_draws_what_plain_sampling_draws():
    n = 64
    logits = torch.randn(n, W, generator=torch.Generator().manual_seed(37)) * 2
    args = make_args(n, torch.arange(n, dtype=torch.int64) % 7, "filtered", seed0=1000)
    v = rejection_accept(logits, args, torch.zeros(n, 0, dtype=torch.int64), torch.zeros(n, 0, W),
                         spec_layout(np.zeros(n, np.int64)))
    assert torch.equal(v.last, sample_group(logits, args))

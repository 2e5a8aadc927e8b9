"""The CPU paged attention kernel (sq_attention, layer_ops_cpu.c) against a float64 reference: GQA groups,
head dims, page sizes, ragged sequences, causal boundaries, and a speculating sequence's k + 1 query
positions beside other sequences; a row's result does not depend on the other rows of the call."""
import pytest
import torch

from slipstream.models.kernels import cpu_kernels

lib = cpu_kernels.native_kernels()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler: the compiled CPU kernels are unavailable")


def make(seqs, hq, hk, d, ps, seed, q_scale=1.0):
    """seqs: (kv_len, query rows) per sequence, the rows its last positions. Pages are shuffled."""
    g = torch.Generator().manual_seed(seed)
    npages = [-(-n // ps) for n, _ in seqs]
    width = max(npages)
    perm = (torch.randperm(sum(npages), generator=g) + 1).tolist()  # page 0 unused
    table = torch.zeros(len(seqs), width, dtype=torch.int64)
    at = 0
    for s, n in enumerate(npages):
        table[s, :n] = torch.tensor(perm[at:at + n])
        at += n
    slots = (sum(npages) + 1) * ps
    k = torch.randn(slots, hk, d, generator=g)
    v = torch.randn(slots, hk, d, generator=g)
    T = sum(t for _, t in seqs)
    ld = hq * d + 16  # rows of q further apart than Hq * D, as in a fused projection
    q = torch.randn(T, ld, generator=g) * q_scale
    qs = torch.tensor([0] + [sum(t for _, t in seqs[:i + 1]) for i in range(len(seqs))])
    lens = torch.tensor([n for n, _ in seqs])
    return q, ld, k, v, qs, lens, table


def run(q, ld, k, v, qs, lens, table, hq, hk, d, ps, window=0):
    out = torch.full((int(qs[-1]), hq * d), float("nan"))
    assert lib.sq_attention(q.data_ptr(), ld, k.data_ptr(), v.data_ptr(), qs.data_ptr(), lens.data_ptr(),
                            table.data_ptr(), table.shape[1], ps, len(lens), hq, hk, d, d ** -0.5, window,
                            out.data_ptr()) == 0
    return out


def reference(q, k, v, qs, lens, table, hq, hk, d, ps, window=0):
    out = torch.zeros(int(qs[-1]), hq, d, dtype=torch.float64)
    for s in range(len(lens)):
        n = int(lens[s])
        idx = torch.tensor([int(table[s, j // ps]) * ps + j % ps for j in range(n)])
        ks, vs = k[idx].double(), v[idx].double()  # [n, hk, d]
        rows = range(int(qs[s]), int(qs[s + 1]))
        for t in rows:
            seen = n - (int(qs[s + 1]) - t) + 1
            lo = max(0, seen - window) if window else 0  # the window: keys (p - window, p]
            qt = q[t, :hq * d].double().view(hq, d)
            for h in range(hq):
                kv = h // (hq // hk)
                w = torch.softmax(ks[lo:seen, kv] @ qt[h] * d ** -0.5, dim=0)
                out[t, h] = w @ vs[lo:seen, kv]
    return out.view(-1, hq * d)


def check(seqs, hq, hk, d, ps, seed, q_scale=1.0, window=0):
    q, ld, k, v, qs, lens, table = make(seqs, hq, hk, d, ps, seed, q_scale)
    out = run(q, ld, k, v, qs, lens, table, hq, hk, d, ps, window)
    ref = reference(q, k, v, qs, lens, table, hq, hk, d, ps, window)
    err = (out.double() - ref).abs().max().item()
    assert err <= 2e-6 * max(1.0, ref.abs().max().item()), (seqs, hq, hk, d, ps, err)
    return out


@pytest.mark.parametrize("hq,hk,d,ps", [(9, 3, 64, 16), (4, 4, 16, 1), (8, 2, 48, 3), (6, 1, 128, 5),
                                        (16, 1, 32, 16)])
def test_matches_float64_on_ragged_sequences(hq, hk, d, ps):
    """Decode rows, a prefill chunk past a block boundary, short and long contexts, a row seeing 1 key."""
    check([(1, 1), (40, 1), (37, 20), (17, 3), (70, 9)], hq, hk, d, ps, seed=hq * 100 + d)


@pytest.mark.parametrize("window", [1, 5, 16, 17, 40])
def test_sliding_window(window):
    """A window shorter than the contexts, on and off the 16-key block grid: decode rows, a prefill chunk
    whose rows begin in different blocks, a context shorter than the window."""
    check([(1, 1), (40, 1), (37, 20), (17, 3), (70, 9), (90, 33)], 8, 2, 32, 5, seed=window, window=window)


def test_windowed_row_does_not_depend_on_the_other_rows():
    hq, hk, d, ps = 4, 2, 16, 4
    q, ld, k, v, qs, lens, table = make([(120, 9), (300, 64)], hq, hk, d, ps, seed=3)
    full = run(q, ld, k, v, qs, lens, table, hq, hk, d, ps, window=23)
    alone = run(q[8:9], ld, k, v, torch.tensor([0, 1]), lens[:1], table[:1], hq, hk, d, ps, window=23)
    assert torch.equal(alone[0], full[8])


def test_speculating_positions_beside_other_sequences():
    """k + 1 = 1..9 query positions of one sequence between decode rows and a chunk; the causal bound
    falls on every lane of a 16-key block across the positions (contexts 14..33)."""
    for k1 in range(1, 10):
        check([(23, 1), (14 + k1 + 10, k1), (31, 5)], 9, 3, 64, 16, seed=k1)


def test_large_scores_stay_finite():
    """Scores in the hundreds: exp overflows unless the running max is subtracted."""
    out = check([(50, 3), (9, 1)], 4, 2, 32, 4, seed=7, q_scale=60.0)
    assert torch.isfinite(out).all()


def test_a_row_does_not_depend_on_the_other_rows():
    """The same sequence's last position, alone, as the last of 9 positions, and beside other sequences
    (more work items, so threads too): bitwise the same."""
    hq, hk, d, ps = 9, 3, 64, 16
    q, ld, k, v, qs, lens, table = make([(120, 9), (300, 64)], hq, hk, d, ps, seed=11)
    full = run(q, ld, k, v, qs, lens, table, hq, hk, d, ps)
    alone = run(q[8:9], ld, k, v, torch.tensor([0, 1]), lens[:1], table[:1], hq, hk, d, ps)
    assert torch.equal(alone[0], full[8])
    four = run(q[5:9], ld, k, v, torch.tensor([0, 4]), lens[:1], table[:1], hq, hk, d, ps)
    assert torch.equal(four, full[5:9])


def test_threads_split_kv_heads_alike():
    """With two threads and one long decode row, the kernel splits work by kv head; with one thread it
    takes all heads in one item: the same bits either way, and right."""
    hq, hk, d, ps = 8, 4, 32, 16
    case = make([(1500, 1)], hq, hk, d, ps, seed=13)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = run(*case, hq, hk, d, ps)
        torch.set_num_threads(1)
        one = run(*case, hq, hk, d, ps)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    q, _, k, v, qs, lens, table = case
    ref = reference(q, k, v, qs, lens, table, hq, hk, d, ps)
    assert (two.double() - ref).abs().max().item() <= 2e-6 * ref.abs().max().item()

"""The Triton paged-attention kernel against `paged_attention_reference`.

Without a GPU the kernel runs on CPU tensors in Triton's interpreter (numpy); the wrapper picks
that mode itself, so nothing here depends on TRITON_INTERPRET or on import order. The cuda-marked
tests run the compiled kernel, including inside a CUDA graph.
"""
import random
import zlib

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402  (not an attribute before import)

from slipstream.models.kernels import attention_blocks as ab  # noqa: E402
from slipstream.models.kernels import attention_triton as at  # noqa: E402
from slipstream.models.kernels.triton_jit import jitted  # noqa: E402
from slipstream.models.kernels.attention import AttentionMetadata, paged_attention_reference  # noqa: E402

SENTINEL = 123.0  # out is prefilled with this: rows the kernel must not write keep it

# Tolerances against a float64 reference of the same (already rounded) inputs. fp32 runs the dots in
# exact ieee mode, so only summation order differs. With bf16/fp16 inputs the kernel rounds the
# softmax weights to the input dtype before the P@V dot (like every flash-attention kernel) and
# rounds the output: bf16 keeps 8 significant bits (relative step 2^-8 = 4e-3), fp16 11 bits (5e-4),
# and outputs here are O(1), so allow a few steps of each.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}

# (name, q_lens, kv_lens, heads, kv_heads, head_dim, page_size, pad_tokens)
CASES = [
    ("decode", [1, 1, 1, 1], [1, 9, 33, 70], 2, 2, 64, 16, 0),
    ("prefill_chunks", [5, 17], [40, 30], 6, 2, 48, 8, 0),
    ("whole_prompts", [7, 20, 33], [7, 20, 33], 4, 1, 16, 16, 0),
    ("mixed_padded", [1, 0, 12, 20, 1, 0], [50, 0, 12, 45, 3, 5], 3, 1, 48, 8, 3),
    ("many_pages", [3, 1], [130, 97], 4, 1, 16, 8, 1),
    ("mixed_gqa3_ps16", [1, 16, 0, 33, 2], [64, 16, 1, 80, 2], 9, 3, 64, 16, 2),
]


def _make(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, pad_tokens, dtype, seed,
          index_dtype=torch.int32, device="cpu", q_strided=False):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    n_pages = [(k + page_size - 1) // page_size for k in kv_lens]
    total_pages = sum(n_pages) + 5  # spare pages nobody owns
    order = list(range(total_pages))
    rng.shuffle(order)  # random, non-contiguous page tables
    width = max(n_pages + [1]) + 2
    tables, i = [], 0
    for n in n_pages:
        # entries past a sequence's pages are garbage the kernel must never follow
        tables.append(order[i:i + n] + [rng.randrange(10**6) for _ in range(width - n)])
        i += n
    query_start = [0]
    for n in q_lens:
        query_start.append(query_start[-1] + n)
    tokens = query_start[-1] + pad_tokens

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    slots = total_pages * page_size
    k_cache, v_cache = rand(slots, kv_heads, head_dim), rand(slots, kv_heads, head_dim)
    used = torch.zeros(slots, dtype=torch.bool)
    for pages, n in zip(tables, kv_lens):
        for pos in range(n):
            used[pages[pos // page_size] * page_size + pos % page_size] = True
    k_cache[~used] = float("nan")  # any read outside a context poisons the output
    v_cache[~used] = float("nan")
    q = rand(tokens, heads + 2, head_dim)[:, 1:heads + 1] if q_strided else rand(tokens, heads, head_dim)
    meta = AttentionMetadata(query_start, list(kv_lens), tables, page_size)
    dev = dict(query_start=torch.tensor(query_start, dtype=index_dtype, device=device),
               kv_lens=torch.tensor(kv_lens, dtype=index_dtype, device=device),
               page_table=torch.tensor(tables, dtype=index_dtype, device=device))
    return q.to(device), k_cache.to(device), v_cache.to(device), meta, dev


def _reference(q, k_cache, v_cache, meta):
    out = torch.full(q.shape, SENTINEL, dtype=torch.float64)
    live = [s for s in range(meta.num_seqs) if meta.query_start[s + 1] > meta.query_start[s]]
    for s in live:  # one sequence at a time: the reference has no use for q_len-0 padding
        m = AttentionMetadata(meta.query_start[s:s + 2], [meta.kv_lens[s]], [meta.page_tables[s]], meta.page_size)
        paged_attention_reference(q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(), m, out)
    return out


def _check(q, k_cache, v_cache, meta, dev, dtype, max_q_len=None):
    out = torch.full(q.shape, SENTINEL, dtype=dtype, device=q.device)
    max_q_len = max_q_len or max(b - a for a, b in zip(meta.query_start, meta.query_start[1:]))
    res = at.paged_attention_triton(q, k_cache, v_cache, dev["query_start"], dev["kv_lens"], dev["page_table"],
                                    meta.page_size, max_q_len, out)
    assert res is out
    ref = _reference(q, k_cache, v_cache, meta)
    got = out.cpu().double()
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol, equal_nan=False)
    return got, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference_interpreted(case, dtype):
    _, q_lens, kv_lens, heads, kv_heads, head_dim, page_size, pad = case
    seed = zlib.crc32(f"{case[0]}/{dtype}".encode()) % 1000
    index_dtype = torch.int64 if seed % 2 else torch.int32
    q, k, v, meta, dev = _make(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, pad, dtype, seed, index_dtype)
    got, _ = _check(q, k, v, meta, dev, dtype)
    first_pad = meta.query_start[-1]
    assert (got[first_pad:] == SENTINEL).all()  # padding token rows untouched
    # and it really ran in the interpreter (a compiled kernel cannot take CPU tensors)
    assert isinstance(jitted(at._grouped_attention_kernel, True), InterpretedFunction)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_interpreted(seed):
    rng = random.Random(seed)
    kv_heads = rng.choice([1, 2])
    heads = kv_heads * rng.choice([1, 3, 4])
    head_dim, page_size = rng.choice([16, 48, 64]), rng.choice([8, 16])
    q_lens, kv_lens = [], []
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["decode", "chunk", "prompt", "pad"])
        kv = rng.randint(1, 90)
        q = {"decode": 1, "chunk": rng.randint(1, kv), "prompt": kv, "pad": 0}[kind]
        q_lens.append(q)
        kv_lens.append(0 if kind == "pad" and rng.random() < 0.5 else kv)
    if not any(q_lens):
        q_lens[0], kv_lens[0] = 1, max(kv_lens[0], 1)
    dtype = rng.choice([torch.float32, torch.bfloat16])
    q, k, v, meta, dev = _make(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, rng.randint(0, 3), dtype, seed,
                               rng.choice([torch.int32, torch.int64]))
    got, _ = _check(q, k, v, meta, dev, dtype)
    assert (got[meta.query_start[-1]:] == SENTINEL).all()


# (q_lens, kv_lens, prefixes): whole prompts with a prefix past one query block (16) and one key
# block, a chunk starting inside its prefix (positions before it reused from a cache) that reaches
# its end, a prefix equal to the context, BOS only (prefix 1), later chunks and a decode past their
# prefix, plain sequences (prefix 0) and a padding sequence beside them
BIDI_SEQS = [([40, 13, 9, 0, 1], [40, 13, 9, 0, 20], [37, 6, 0, 0, 6]),
             ([10, 20, 5, 7], [12, 20, 30, 7], [7, 20, 8, 1])]


def _bidi_reference(q, k_cache, v_cache, meta, prefixes):
    out = torch.full(q.shape, SENTINEL, dtype=torch.float64)
    for s in range(meta.num_seqs):
        if meta.query_start[s + 1] > meta.query_start[s]:
            m = AttentionMetadata(meta.query_start[s:s + 2], [meta.kv_lens[s]], [meta.page_tables[s]],
                                  meta.page_size, bidirectional_lens=[prefixes[s]])
            paged_attention_reference(q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(), m, out)
    return out


@pytest.mark.parametrize("flat", [False, True], ids=["grid", "block_table"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("seqs", range(len(BIDI_SEQS)))
def test_bidirectional_prefix_matches_reference_interpreted(seqs, dtype, flat):
    """With `bidirectional_lens` a query inside its sequence's prefix sees the whole prefix (the
    reference's mask); prefix 0 and queries past the prefix stay causal, and a prefix tensor of
    zeros gives bitwise the output of the kernel without one (the text path)."""
    q_lens, kv_lens, prefixes = BIDI_SEQS[seqs]
    q, k, v, meta, dev = _make(q_lens, kv_lens, 4, 2, 16, 8, 2, dtype, 40 + seqs)
    bidi = torch.tensor(prefixes, dtype=dev["kv_lens"].dtype)
    blocks = None
    if flat:
        blocks = torch.tensor(ab.query_blocks(q_lens, ab.num_query_programs(q.shape[0] + 8, len(q_lens) + 1)),
                              dtype=torch.int64)
    args = (q, k, v, dev["query_start"], dev["kv_lens"], dev["page_table"], meta.page_size, max(q_lens))
    out = torch.full(q.shape, SENTINEL, dtype=dtype)
    at.paged_attention_triton(*args, out, blocks=blocks, bidirectional_lens=bidi)
    ref = _bidi_reference(q, k, v, meta, prefixes)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    assert (out[meta.query_start[-1]:] == SENTINEL).all()
    # the prefix is really seen: plain causal attention differs on the prefixed sequences
    causal = _reference(q, k, v, meta)
    assert (causal - ref).abs().max() > 0.05
    plain, zeros = (torch.full(q.shape, SENTINEL, dtype=dtype) for _ in range(2))
    at.paged_attention_triton(*args, plain, blocks=blocks)
    at.paged_attention_triton(*args, zeros, blocks=blocks, bidirectional_lens=torch.zeros_like(bidi))
    assert torch.equal(plain, zeros)


def test_query_blocks_table():
    table = ab.query_blocks([1, 0, 17, 16, 33], ab.num_query_programs(67, 5))
    assert ab.num_query_programs(67, 5) == 67 // ab.BLOCK_M + 5 == 9
    assert table[0].tolist() == [0, 2, 2, 3, 4, 4, 4, 0, 0]
    assert table[1].tolist() == [0, 0, 16, 0, 0, 16, 32, ab.PAST_END, ab.PAST_END]
    worst = [1] * 7 + [ab.BLOCK_M + 1] * 2  # the bound is tight: every sequence ends one past a block
    assert ab.query_blocks(worst, ab.num_query_programs(sum(worst), len(worst)))[1, -1] != ab.PAST_END
    with pytest.raises(ValueError, match="exceed"):
        ab.query_blocks([17], 1)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_block_table_grid_equals_the_sequence_grid_interpreted(case):
    """The flat grid of a mixed-step graph (programs from a device table, sized by the token count:
    padding sequences and unused entries past the last block included) gives bitwise the same output
    as the (sequence, head, block) grid, and the reference's."""
    _, q_lens, kv_lens, heads, kv_heads, head_dim, page_size, pad = case
    q, k, v, meta, dev = _make(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, pad, torch.float32, 17)
    grid_out, _ = _check(q, k, v, meta, dev, torch.float32)
    tokens, seqs = q.shape[0] + 20, len(q_lens) + 2  # a bucket larger than the step: unused programs
    blocks = torch.tensor(ab.query_blocks(q_lens, ab.num_query_programs(tokens, seqs)), dtype=dev["kv_lens"].dtype)
    assert (blocks[1] == ab.PAST_END).any()
    out = torch.full(q.shape, SENTINEL, dtype=torch.float32)
    at.paged_attention_triton(q, k, v, dev["query_start"], dev["kv_lens"], dev["page_table"], page_size, 0, out,
                              blocks=blocks)
    assert torch.equal(out.double(), grid_out)


def test_loose_max_q_len_and_strided_q():
    """max_q_len is only a bound (extra programs must exit cleanly); q may be a strided view."""
    q, k, v, meta, dev = _make([3, 18], [10, 25], 4, 2, 48, 16, 2, torch.float32, 7, q_strided=True)
    assert not q.is_contiguous()
    _check(q, k, v, meta, dev, torch.float32, max_q_len=64)


def test_metadata_updated_in_place_is_honoured():
    """What a CUDA-graph replay relies on: the same tensors, new values, a new (correct) answer."""
    q, k, v, meta, dev = _make([1, 1, 1], [5, 17, 40], 4, 2, 16, 8, 0, torch.float32, 3)
    _check(q, k, v, meta, dev, torch.float32, max_q_len=1)
    meta.kv_lens = [4, 16, 39]  # the same pages, one token shorter each
    dev["kv_lens"].copy_(torch.tensor(meta.kv_lens))
    _check(q, k, v, meta, dev, torch.float32, max_q_len=1)


def test_rejects_bad_input():
    q, k, v, meta, dev = _make([2], [4], 4, 2, 16, 8, 0, torch.float32, 1)
    qs, kl, pt = dev["query_start"], dev["kv_lens"], dev["page_table"]
    out = torch.empty_like(q)
    call = at.paged_attention_triton
    with pytest.raises(TypeError, match="one dtype"):
        call(q, k.bfloat16(), v.bfloat16(), qs, kl, pt, 8, 2, out)
    with pytest.raises(TypeError, match="one dtype"):
        call(q.double(), k.double(), v.double(), qs, kl, pt, 8, 2, out.double())
    with pytest.raises(ValueError, match="multiple of kv heads"):
        call(q[:, :3], k, v, qs, kl, pt, 8, 2, out[:, :3])
    with pytest.raises(ValueError, match="dims must match"):
        call(q, k[..., :8], v[..., :8], qs, kl, pt, 8, 2, out)
    with pytest.raises(ValueError, match=r"query_start \[S\+1\]"):
        call(q, k, v, qs[:1], kl, pt, 8, 2, out)
    with pytest.raises(TypeError, match="int32 or int64"):
        call(q, k, v, qs, kl, pt.float(), 8, 2, out)
    with pytest.raises(ValueError, match="contiguous last"):
        call(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, qs, kl, pt, 8, 2, out)
    with pytest.raises(ValueError, match=r"\[2, P\] int32/int64"):
        call(q, k, v, qs, kl, pt, 8, 2, out, blocks=torch.zeros(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"bidirectional_lens must be an int32/int64 \[S\]"):
        call(q, k, v, qs, kl, pt, 8, 2, out, bidirectional_lens=torch.zeros(2, dtype=torch.int64))


def test_clear_error_without_triton(monkeypatch):
    q, k, v, meta, dev = _make([1], [3], 2, 2, 16, 8, 0, torch.float32, 2)
    from slipstream.models.kernels import triton_jit

    monkeypatch.setattr(triton_jit, "triton", None)  # what an install without triton sees
    with pytest.raises(RuntimeError, match="needs the `triton` package"):
        at.paged_attention_triton(q, k, v, dev["query_start"], dev["kv_lens"], dev["page_table"], 8, 1,
                                  torch.empty_like(q))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("case", CASES + [("long", [100, 1, 0, 64], [300, 1000, 0, 64], 12, 4, 128, 16, 5)],
                         ids=[c[0] for c in CASES] + ["long"])
def test_matches_reference_compiled_cuda(case, dtype):
    _, q_lens, kv_lens, heads, kv_heads, head_dim, page_size, pad = case
    q, k, v, meta, dev = _make(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, pad, dtype, 11,
                               device="cuda")
    got, _ = _check(q, k, v, meta, dev, dtype)
    assert (got[meta.query_start[-1]:] == SENTINEL).all()
    assert not isinstance(jitted(at._grouped_attention_kernel, False), InterpretedFunction)


@pytest.mark.cuda
def test_cuda_graph_replay_follows_metadata():
    dtype = torch.bfloat16
    q, k, v, meta, dev = _make([1, 1, 1, 1], [9, 40, 70, 130], 9, 3, 64, 16, 0, dtype, 5, device="cuda")
    out = torch.full(q.shape, SENTINEL, dtype=dtype, device="cuda")
    args = (q, k, v, dev["query_start"], dev["kv_lens"], dev["page_table"], 16, 1, out)
    at.paged_attention_triton(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        at.paged_attention_triton(*args)
    for kv_lens in ([9, 40, 70, 130], [3, 33, 64, 120]):
        meta.kv_lens = kv_lens
        dev["kv_lens"].copy_(torch.tensor(kv_lens))
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.cpu().double(), _reference(q, k, v, meta), atol=TOL[dtype][0],
                                   rtol=TOL[dtype][1])



@pytest.mark.cuda
def test_cuda_graph_with_block_table_replays_other_mixes_of_the_same_token_bucket():
    """A mixed-step graph: captured once for (T tokens, S sequences), replayed for other mixes whose
    query lengths, context lengths and block tables are rewritten in place."""
    dtype, tokens, seqs, ps = torch.bfloat16, 64, 4, 16
    mixes = [([1, 1, 30, 0], [20, 9, 50, 0]), ([40, 0, 0, 0], [40, 0, 0, 0]), ([1, 17, 16, 1], [64, 17, 33, 2])]
    q, k, v, meta, dev = _make([16] * seqs, [80] * seqs, 9, 3, 64, ps, 0, dtype, 5, device="cuda")
    programs = ab.num_query_programs(tokens, seqs)
    blocks = torch.zeros(2, programs, dtype=torch.int64, device="cuda")
    out = torch.full(q.shape, SENTINEL, dtype=dtype, device="cuda")
    args = (q, k, v, dev["query_start"], dev["kv_lens"], dev["page_table"], ps, 0, out)
    blocks.copy_(torch.from_numpy(ab.query_blocks([16] * seqs, programs)))
    at.paged_attention_triton(*args, blocks=blocks)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        at.paged_attention_triton(*args, blocks=blocks)
    for q_lens, kv_lens in mixes:
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        meta.query_start, meta.kv_lens = starts, kv_lens
        dev["query_start"].copy_(torch.tensor(starts))
        dev["kv_lens"].copy_(torch.tensor(kv_lens))
        blocks.copy_(torch.from_numpy(ab.query_blocks(q_lens, programs)))
        out.fill_(SENTINEL)
        graph.replay()
        torch.cuda.synchronize()
        ref = _reference(q, k, v, meta)
        torch.testing.assert_close(out.cpu().double(), ref, atol=TOL[dtype][0], rtol=TOL[dtype][1])


WINDOW_CASES = [  # (name, q_lens, kv_lens, heads, kv_heads, head_dim, page_size, splits, flat)
    ("prefill_chunks", [5, 17, 1], [40, 30, 9], 4, 2, 16, 8, None, False),
    ("flat_grid", [1, 0, 12, 20, 1], [50, 0, 12, 45, 3], 3, 1, 16, 8, None, True),
    ("decode_splits", [1, 1], [600, 300], 2, 1, 16, 16, 3, False),  # splits wholly before the window
]


@pytest.mark.parametrize("window", [1, 7, 20])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=[c[0] for c in WINDOW_CASES])
def test_sliding_window_matches_reference_interpreted(case, window):
    """A query at position p sees keys (p - window, p]: tiles before the window skipped, rows whose window
    starts inside a tile or past a decode split masked, as the reference's window mask."""
    _, q_lens, kv_lens, heads, kv_heads, head_dim, page_size, splits, flat = case
    q, k, v, meta, dev = _make(q_lens, kv_lens, heads, kv_heads, head_dim, page_size, 0, torch.float32, window)
    out = torch.full(q.shape, SENTINEL, dtype=torch.float32)
    blocks = None
    if flat:
        programs = ab.num_query_programs(q.shape[0] + 8, len(q_lens) + 1)
        blocks = torch.tensor(ab.query_blocks(q_lens, programs), dtype=dev["kv_lens"].dtype)
    at.paged_attention_triton(q, k, v, dev["query_start"], dev["kv_lens"], dev["page_table"], page_size,
                              max(q_lens), out, blocks=blocks, splits=splits, window=window)
    ref = torch.full(q.shape, SENTINEL, dtype=torch.float64)
    for s in range(meta.num_seqs):
        if meta.query_start[s + 1] > meta.query_start[s]:
            m = AttentionMetadata(meta.query_start[s:s + 2], [meta.kv_lens[s]], [meta.page_tables[s]], page_size)
            paged_attention_reference(q.double(), k.double(), v.double(), m, ref, window=window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, equal_nan=False)

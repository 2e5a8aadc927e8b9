"""The grouped paged-attention kernel's own cases (issue 42), in Triton's interpreter: GQA groups of
1, 3, 4, 5 and 7 at decode and in mixed steps, split-KV decode at and around its split boundaries,
fresh random inputs against the float64 reference, outputs and split workspaces poisoned, and the
per-head kernel it replaced still reachable (the benchmark's baseline). tests/test_attention_triton.py
has the shared helpers and the original cases."""
import random

import pytest
import torch

pytest.importorskip("triton")

from slipstream.models.kernels import attention_blocks as ab  # noqa: E402
from slipstream.models.kernels import attention_triton as at  # noqa: E402
from test_attention_triton import SENTINEL, TOL, _make, _reference  # noqa: E402


def _run(q, k, v, dev, meta, dtype, max_q_len=None, fill=SENTINEL, **kw):
    out = torch.full(q.shape, fill, dtype=dtype)
    if max_q_len is None:
        max_q_len = max(b - a for a, b in zip(meta.query_start, meta.query_start[1:]))
    at.paged_attention_triton(q, k, v, dev["query_start"], dev["kv_lens"], dev["page_table"], meta.page_size,
                              max_q_len, out, **kw)
    return out


def _assert_matches(out, q, k, v, meta, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.double(), _reference(q, k, v, meta), atol=atol, rtol=rtol)


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Split partials start as NaN: a merge that reads a split nobody wrote poisons the output."""
    monkeypatch.setattr(at, "_workspace", lambda n, device: torch.full((n,), float("nan"), device=device))
    monkeypatch.setattr(at, "MIN_SPLIT", 64)  # splits of 128 keys (one decode tile): boundaries at small contexts


# (heads, kv_heads, head_dim): GQA groups 1, 3, 4 and 5, 7 (a prefill tile of 16 queries is cut in sub-blocks)
GROUPS = [(2, 2, 64), (9, 3, 64), (8, 2, 32), (5, 1, 16), (14, 2, 64)]


@pytest.mark.parametrize("shape", GROUPS, ids=lambda s: f"group{s[0] // s[1]}")
@pytest.mark.parametrize("step", ["decode", "mixed", "mixed_flat"])
def test_gqa_groups_match_reference(shape, step, poisoned_workspace):
    heads, kv_heads, head_dim = shape
    seed = heads * 100 + len(step)
    rng = random.Random(seed)
    if step == "decode":  # a padding sequence (q_len 0) between real ones
        q_lens, kv_lens = [1, 1, 0, 1], [rng.randint(1, 300), rng.randint(1, 40), 0, 129]
    else:
        q_lens, kv_lens = [1, 21, 0, 3, 16], [rng.randint(1, 200), 40, 0, 3, 50]
    dtype = [torch.float32, torch.bfloat16, torch.float16][seed % 3]
    q, k, v, meta, dev = _make(q_lens, kv_lens, heads, kv_heads, head_dim, 16, 2, dtype, seed,
                               torch.int64 if seed % 2 else torch.int32)
    blocks = None
    if step == "mixed_flat":
        programs = ab.num_query_programs(q.shape[0] + 16, len(q_lens))
        blocks = torch.tensor(ab.query_blocks(q_lens, programs), dtype=dev["kv_lens"].dtype)
    out = _run(q, k, v, dev, meta, dtype, blocks=blocks, splits=3 if step == "decode" else None)
    _assert_matches(out, q, k, v, meta, dtype)
    assert (out[meta.query_start[-1]:] == SENTINEL).all()  # padding token rows untouched


def test_split_boundaries_and_counts(poisoned_workspace):
    """Decode contexts at, one below and one past split lengths (MIN_SPLIT 64, multiples of the
    fp32 key tile of 32), for split counts from 1 (no split) to more than any context fills; every
    count agrees with the reference, and a context of one split gives bitwise the unsplit output."""
    kv_lens = [1, 63, 64, 65, 127, 128, 129, 255, 256, 257, 600]
    q_lens = [1] * len(kv_lens)
    dtype = torch.float32  # (bf16 would round the split and unsplit sums to the same bits)
    q, k, v, meta, dev = _make(q_lens, kv_lens, 6, 2, 64, 16, 1, dtype, 5)
    unsplit = _run(q, k, v, dev, meta, dtype, splits=1)
    _assert_matches(unsplit, q, k, v, meta, dtype)
    for splits in (2, 3, 5, 8, 32):
        out = _run(q, k, v, dev, meta, dtype, splits=splits)
        _assert_matches(out, q, k, v, meta, dtype)
        assert (out[len(kv_lens):] == SENTINEL).all()
        assert torch.equal(out[:3], unsplit[:3])  # kv <= MIN_SPLIT: one split, written directly
        assert not torch.equal(out[10], unsplit[10])  # 600 keys really are split
        assert torch.equal(out, _run(q, k, v, dev, meta, dtype, splits=splits))  # the same bits again


@pytest.mark.parametrize("seed", range(3))
def test_random_decode_splits_match_reference(seed, poisoned_workspace):
    """Fresh random decode batches (padding sequences, both index dtypes, fp32/fp16, prefixes) at a
    random split count."""
    rng = random.Random(1000 + seed)
    kv_heads = rng.choice([1, 2, 3])
    heads, head_dim = kv_heads * rng.choice([1, 3, 4]), rng.choice([16, 64, 128])
    kv_lens = [rng.choice([0, rng.randint(1, 130), rng.randint(130, 700)]) for _ in range(rng.randint(1, 4))]
    q_lens = [1 if n else 0 for n in kv_lens]
    if not any(q_lens):
        q_lens[0], kv_lens[0] = 1, 300
    dtype = rng.choice([torch.float32, torch.float16])
    q, k, v, meta, dev = _make(q_lens, kv_lens, heads, kv_heads, head_dim, rng.choice([8, 16]), rng.randint(0, 2),
                               dtype, seed, rng.choice([torch.int32, torch.int64]))
    out = _run(q, k, v, dev, meta, dtype, splits=rng.randint(2, 9))
    _assert_matches(out, q, k, v, meta, dtype)
    assert (out[meta.query_start[-1]:] == SENTINEL).all()


def test_split_decode_with_a_bidirectional_prefix(poisoned_workspace):
    """A decode past its prefix is causal over the whole context: a prefix changes nothing, split or not."""
    q, k, v, meta, dev = _make([1, 1], [300, 40], 4, 2, 16, 8, 0, torch.float32, 9)
    bidi = torch.tensor([200, 40], dtype=dev["kv_lens"].dtype)
    out = _run(q, k, v, dev, meta, torch.float32, splits=4, bidirectional_lens=bidi)
    _assert_matches(out, q, k, v, meta, torch.float32)


@pytest.mark.parametrize("flat", [False, True])
def test_per_head_kernel_still_matches_reference(flat):
    """The benchmark's baseline (impl="per_head") computes the same attention."""
    q_lens, kv_lens = [1, 17, 0, 2], [64, 30, 0, 9]
    q, k, v, meta, dev = _make(q_lens, kv_lens, 9, 3, 64, 16, 1, torch.float32, 3)
    blocks = None
    if flat:
        blocks = torch.tensor(ab.query_blocks(q_lens, ab.num_query_programs(q.shape[0], 4)), dtype=torch.int64)
    out = _run(q, k, v, dev, meta, torch.float32, impl="per_head", blocks=blocks)
    _assert_matches(out, q, k, v, meta, torch.float32)
    assert (out[meta.query_start[-1]:] == SENTINEL).all()
    grouped = _run(q, k, v, dev, meta, torch.float32, blocks=blocks)
    torch.testing.assert_close(out, grouped, atol=1e-5, rtol=1e-5)


def test_decode_splits_and_tiles():
    assert at.decode_splits(1, 3, 1 << 20, 132) == 32  # capped: 2 * 132 / 3 = 88 programs per pair wanted
    assert at.decode_splits(1, 3, 8192, 132) == 32  # an 8,192-key page table fills 32 splits of 256
    assert at.decode_splits(1, 3, 1024, 132) == 4  # a 1,024-key page table fills 4 splits of 256
    assert at.decode_splits(32, 3, 8192, 132) == 3  # 96 pairs: ~2 programs per SM
    assert at.decode_splits(44, 3, 8192, 132) == 1  # 132 pairs fill the SMs
    assert at.decode_splits(256, 3, 8192, 132) == 1
    assert at.decode_splits(1, 1, 16, 132) == 1  # one split of any context
    decode = at.tiles(3, 64, torch.bfloat16, decode=True)
    assert (decode["QB"], decode["BLOCK_M"], decode["BLOCK_N"]) == (1, 16, 128)
    # prefill rows (query, head): up to 64 for 16-bit head_dim 64, else 16 (spill-free on sm_90)
    for group, head_dim, dtype, rows in ((1, 64, torch.bfloat16, 16), (3, 64, torch.bfloat16, 48),
                                         (7, 64, torch.float16, 56), (4, 128, torch.bfloat16, 16),
                                         (3, 64, torch.float32, 12), (8, 256, torch.bfloat16, 16)):
        t = at.tiles(group, head_dim, dtype, decode=False)
        assert t["QB"] * group == rows and t["Q_BLOCK"] % t["QB"] == 0 and t["BLOCK_M"] <= 64
    q, k, v, meta, dev = _make([1], [3], 2, 2, 16, 8, 0, torch.float32, 2)
    with pytest.raises(ValueError, match="impl must be one of"):
        _run(q, k, v, dev, meta, torch.float32, impl="fast")
    with pytest.raises(ValueError, match="splits in 1..32"):
        _run(q, k, v, dev, meta, torch.float32, splits=at.MAX_SPLITS + 1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_split_decode_graph_replays_follow_metadata_and_repeat_bitwise_cuda(dtype):
    """A captured split decode (the split count fixed at capture, from host ints) replayed after the
    context lengths change in place: right against the reference, the same bits on every replay, and
    near the per-head kernel."""
    kv_lens = [2000, 700, 33, 0, 1]
    q_lens = [1 if n else 0 for n in kv_lens]
    q, k, v, meta, dev = _make(q_lens, kv_lens, 9, 3, 64, 16, 0, dtype, 21, device="cuda")
    assert at.decode_splits(len(kv_lens), 3, dev["page_table"].shape[1] * 16, at._sm_count(q.device)) > 1
    out = torch.full(q.shape, SENTINEL, dtype=dtype, device="cuda")
    args = (q, k, v, dev["query_start"], dev["kv_lens"], dev["page_table"], 16, 1, out)
    at.paged_attention_triton(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        at.paged_attention_triton(*args)
    for lens in (kv_lens, [1999, 257, 32, 0, 1], [511, 700, 1, 0, 1]):  # (within the pages _make gave)
        meta.kv_lens = lens
        dev["kv_lens"].copy_(torch.tensor(lens))
        outs = []
        for _ in range(2):
            out.fill_(SENTINEL)
            graph.replay()
            torch.cuda.synchronize()
            outs.append(out.clone())
        assert torch.equal(outs[0], outs[1])
        _assert_matches(out.cpu(), q.cpu(), k.cpu(), v.cpu(), meta, dtype)
        old = torch.full_like(out, SENTINEL)
        at.paged_attention_triton(*args[:-1], old, impl="per_head")
        torch.testing.assert_close(out, old, atol=TOL[dtype][0], rtol=TOL[dtype][1])

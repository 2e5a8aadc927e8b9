"""The fused decode layer's kernels (decode_fused_triton.py) against float64 references (interpreted
on CPU tensors here, compiled in the `cuda` tests): rows 1, 3, 15 (with the padding row 2, 4, 16
kernel rows: the GEMV path, row tiles of 2, 4, 16) and 17 (18: tl.dot, two row tiles), each plus a
padding row of NaN (a mixed graph's garbage row) whose K/V go to a scratch slot and must not reach
the real rows. Outputs are poisoned first; cache slots the step does not own must keep their poison."""
import pytest
import torch

pytest.importorskip("triton")

from slipstream.models.config import tiny_config  # noqa: E402
from slipstream.models.kernels import decode_fused_triton as dft  # noqa: E402
from slipstream.models.kernels.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
ROWS = [1, 3, 15, 17]
SENTINEL = 123.0
SCRATCH = 0  # the padding row's KV slot
# Against float64: fp32 is order of operations; bf16 the kernels round like the bf16 reference path
# (normed row, projection, rotary/SiLU, product, residual sum), each a 2^-8 relative step, which the
# interpreter takes towards zero.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (5e-2, 5e-2)}


def _device(name):
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return name


def _close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=rtol, atol=atol)


def _with_padding_row(x):
    """x with one more row of NaN: what a graph's padding row may hold."""
    return torch.cat([x, torch.full_like(x[:1], float("nan"))])


@pytest.mark.filterwarnings(r"ignore:invalid value encountered:RuntimeWarning")  # the NaN padding row
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads,kv_heads,bias", [(4, 2, False), (3, 1, True)])
def test_norm_qkv_rotary_matches_float64(device, dtype, rows, heads, kv_heads, bias):
    device = _device(device)
    cfg = tiny_config()
    rope = RotaryEmbedding(cfg)
    d, hidden, slots = cfg.head_dim, 100, 40  # hidden not a multiple of the K tile: a masked tail
    g = torch.Generator().manual_seed(1000 * rows + heads)
    width = (heads + 2 * kv_heads) * d
    x = (3 * torch.randn(rows, hidden, generator=g)).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    w = (torch.randn(width, hidden, generator=g) / 10).to(dtype)
    b = torch.randn(width, generator=g).to(dtype) if bias else None
    positions = torch.randint(0, 1024, (rows,), generator=g)
    kv_indices = 1 + torch.randperm(slots - 1, generator=g)[:rows]  # slot 0 is the padding row's
    want_k = torch.full((slots, kv_heads, d), SENTINEL, dtype=torch.float64)
    want_v = want_k.clone()
    want_q = dft.norm_qkv_rotary_reference(
        x.double(), norm_w.double(), 1e-5, w.double(), None if b is None else b.double(), heads, kv_heads, positions,
        rope.cos.double(), rope.sin.double(), want_k, want_v, kv_indices)

    on = dict(device=device)
    k_cache = torch.full((slots, kv_heads, d), SENTINEL, dtype=dtype, **on)
    v_cache = k_cache.clone()
    out = torch.full((rows + 1, heads, d), float("nan"), dtype=dtype, **on)
    got = dft.norm_qkv_rotary_triton(
        _with_padding_row(x).to(**on), norm_w.to(**on), 1e-5, w.to(**on), None if b is None else b.to(**on), heads,
        kv_heads, torch.cat([positions, positions[:1]]).to(**on), rope.cos.to(**on), rope.sin.to(**on), k_cache,
        v_cache, torch.cat([kv_indices, torch.tensor([SCRATCH])]).to(**on), out=out)
    assert got is out
    _close(got[:rows], want_q, dtype)
    owned = torch.zeros(slots, dtype=torch.bool)
    owned[kv_indices] = True
    _close(k_cache.cpu()[owned], want_k[owned], dtype)
    _close(v_cache.cpu()[owned], want_v[owned], dtype)
    assert (k_cache.cpu()[~owned][1:] == SENTINEL).all() and (v_cache.cpu()[~owned][1:] == SENTINEL).all()


@pytest.mark.filterwarnings(r"ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rows", ROWS)
def test_linear_residual_matches_float64(device, dtype, rows):
    device = _device(device)
    g = torch.Generator().manual_seed(rows)
    k, n = 150, 70  # masked tails in k and n
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / 10).to(dtype)
    residual = (3 * torch.randn(rows, n, generator=g)).to(dtype)
    want = residual.double()
    dft.linear_residual_reference(x.double(), w.double(), want)
    got = _with_padding_row(residual).to(device)
    dft.linear_residual_triton(_with_padding_row(x).to(device), w.to(device), got)
    _close(got[:rows], want, dtype)


@pytest.mark.filterwarnings(r"ignore:(overflow|invalid value) encountered:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rows", ROWS)
def test_norm_gate_up_silu_matches_float64(device, dtype, rows):
    device = _device(device)
    g = torch.Generator().manual_seed(10 + rows)
    hidden, inter = 100, 40  # masked tails in k and n
    x = (3 * torch.randn(rows, hidden, generator=g)).to(dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    w = (torch.randn(2 * inter, hidden, generator=g) / 10).to(dtype)
    want = dft.norm_gate_up_silu_reference(x.double(), norm_w.double(), 1e-5, w.double())
    out = torch.full((rows + 1, inter), float("nan"), dtype=dtype, device=device)
    got = dft.norm_gate_up_silu_triton(_with_padding_row(x).to(device), norm_w.to(device), 1e-5, w.to(device), out=out)
    assert got is out
    _close(got[:rows], want, dtype)


def test_decode_kernels_refuse_bad_shapes():
    x, w, c = torch.randn(2, 8), torch.randn(8, 8), torch.randn(16, 8)
    cache, idx = torch.randn(4, 1, 4), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="expected x"):  # 8 rows are not (2 + 2) heads of an even D
        dft.norm_qkv_rotary_triton(x, torch.ones(8), 1e-5, torch.randn(12, 8), None, 2, 1, idx, c, c, cache, cache, idx)
    with pytest.raises(TypeError, match="one dtype"):
        dft.norm_qkv_rotary_triton(x, torch.ones(8), 1e-5, w.double(), None, 1, 1, idx, c, c, cache, cache, idx)
    with pytest.raises(ValueError, match="expected x"):
        dft.linear_residual_triton(x, w, torch.randn(3, 8))
    with pytest.raises(ValueError, match="gate-up weight"):
        dft.norm_gate_up_silu_triton(x, torch.ones(8), 1e-5, torch.randn(7, 8))
    with pytest.raises(ValueError, match="out must be"):
        dft.norm_gate_up_silu_triton(x, torch.ones(8), 1e-5, torch.randn(8, 8), out=torch.empty(2, 3))


def test_small_steps_take_the_gemv_path_with_many_programs():
    """Up to GEMV_MAX_ROWS rows no tl.dot and >= 120 programs a SmolLM2 GEMV (the tl.dot tiles gave 30-36)."""
    hidden, inter, heads, kv_heads, d = 576, 1536, 9, 3, 64
    for rows in (1, dft.GEMV_MAX_ROWS):
        qkv = dft.qkv_launch(hidden, torch.bfloat16, rows)
        assert qkv["GEMV"] and qkv["BLOCK_M"] == rows
        assert (heads + 2 * kv_heads) * -(-d // 2 // qkv["BLOCK_H"]) >= 120
        for k, n, gate_up in ((hidden, hidden, False), (inter, hidden, False), (hidden, inter, True)):
            lin = dft.linear_launch(k, n, torch.bfloat16, gate_up, rows)
            assert lin["GEMV"] and lin["BLOCK_M"] == rows and -(-n // lin["BLOCK_N"]) >= 128
            assert rows * lin["BLOCK_N"] * (2 if gate_up else 1) * lin["BLOCK_K"] <= dft._GEMV_BUDGET
    assert not dft.qkv_launch(hidden, torch.bfloat16, dft.GEMV_MAX_ROWS + 1)["GEMV"]
    assert not dft.linear_launch(hidden, hidden, torch.bfloat16, False, dft.GEMV_MAX_ROWS + 1)["GEMV"]

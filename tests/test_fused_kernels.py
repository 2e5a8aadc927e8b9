"""The triton backend's fused kernels against their references (interpreted on CPU tensors here,
compiled in the `cuda` tests) and projection fusion. The whole model: tests/test_fused_model.py.

Outputs are poisoned first (NaN or a sentinel) so an element a kernel should write but does not
shows, and one it must not touch is checked to keep its poison."""
import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from slipstream.models.kernels.add_norm_triton import add_rms_norm_reference, add_rms_norm_triton  # noqa: E402
from slipstream.models.config import tiny_config  # noqa: E402
from slipstream.models.kernels.fused_projections import fuse_linears, is_fused_view  # noqa: E402
from slipstream.models.kernels.gate_up_silu_triton import gate_up_silu_reference, gate_up_silu_triton  # noqa: E402
from slipstream.models.kernels.rotary import RotaryEmbedding  # noqa: E402
from slipstream.models.kernels.rotary_kv_triton import rotary_kv_reference, rotary_kv_triton  # noqa: E402
from slipstream.models.kernels.silu_mul_triton import silu_mul_reference, silu_mul_triton  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
# fp32: order of operations only; bf16: one rounding step of the output (2^-8 relative) at most
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
SENTINEL = 123.0


def _device(name):
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return name


def _close(got, want, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("mode", ["add", "plain", "rows", "plain_rows"])
def test_add_rms_norm_matches_reference(device, dtype, mode):
    device = _device(device)
    g = torch.Generator().manual_seed(len(mode))
    rows, hidden = 7, 100  # hidden not a power of two: masked tail
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device=device, dtype=dtype)
    residual = (3 * torch.randn(rows, hidden, generator=g)).to(device=device, dtype=dtype)
    x = None if mode.startswith("plain") else torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype)
    idx = torch.tensor([6, 0, 3, 0], device=device) if mode.endswith("rows") else None
    want_res = residual.clone()
    want = add_rms_norm_reference(x, want_res, weight, 1e-5, rows=idx)
    before = residual.clone()
    got = add_rms_norm_triton(x, residual, weight, 1e-5, rows=idx)
    assert got.shape == want.shape and got.dtype == dtype
    _close(got, want, dtype)
    if mode == "add":  # the sum is stored in place, rounded as the reference's add
        assert not residual.equal(before)
        if dtype == torch.float32 or device == "cuda":
            assert residual.equal(want_res)
        else:  # the interpreter rounds fp32 -> bf16 towards zero (the GPU to nearest even): one step
            _close(residual, want_res, dtype)
    else:  # nothing to store (plain) or nobody reads it (rows)
        assert residual.equal(before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("tokens,heads,kv_heads", [(1, 4, 2), (5, 3, 1)])
def test_rotary_kv_matches_reference_on_fused_qkv_views(device, dtype, tokens, heads, kv_heads):
    device = _device(device)
    cfg = tiny_config()
    rope = RotaryEmbedding(cfg).to(device)
    d, slots = cfg.head_dim, 32
    g = torch.Generator().manual_seed(tokens * 10 + heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g).to(device=device, dtype=dtype)

    def split(t):
        q, k, v = t.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
        return q.view(tokens, heads, d), k.view(tokens, kv_heads, d), v.view(tokens, kv_heads, d)

    positions = torch.randint(0, 1024, (tokens,), generator=g).to(device)
    kv_indices = torch.randperm(slots, generator=g)[:tokens].to(device)
    caches = [torch.full((slots, kv_heads, d), SENTINEL, dtype=dtype, device=device) for _ in range(4)]
    ref_qkv = qkv.clone()
    rotary_kv_reference(*split(ref_qkv), positions, rope.cos, rope.sin, caches[0], caches[1], kv_indices)
    q, k, v = split(qkv)
    assert tokens == 1 or k.stride(0) == qkv.stride(0)  # strided views into the fused output
    k_before, v_before = k.clone(), v.clone()
    rotary_kv_triton(q, k, v, positions, rope.cos, rope.sin, caches[2], caches[3], kv_indices)
    _close(q, split(ref_qkv)[0], dtype)  # q rotated in place
    assert k.equal(k_before) and v.equal(v_before)  # the sources are only read
    _close(caches[2], caches[0], dtype)  # rotated k, and only at the tokens' KV indices
    assert caches[3].equal(caches[1])  # v copied bit for bit
    untouched = torch.ones(slots, dtype=torch.bool, device=device)
    untouched[kv_indices] = False
    assert (caches[2][untouched] == SENTINEL).all() and (caches[3][untouched] == SENTINEL).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rows,inter", [(1, 96), (3, 1500)])  # 1500: two column blocks, a masked tail
def test_silu_mul_matches_reference_on_fused_gate_up(device, dtype, rows, inter):
    device = _device(device)
    g = torch.Generator().manual_seed(rows)
    gate_up = (4 * torch.randn(rows, 2 * inter, generator=g)).to(device=device, dtype=dtype)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    got = silu_mul_triton(gate, up)
    assert got.is_contiguous() and got.shape == (rows, inter)
    _close(got, silu_mul_reference(gate, up), dtype)


# bf16 in the interpreter: four roundings (gate, up, silu, product), each towards zero there
GEMM_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (4e-2, 2e-2)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rows", [1, 20, 70])  # the three tile shapes; 70: two row blocks, masked
def test_gate_up_silu_gemm_matches_reference(device, dtype, rows):
    device = _device(device)
    g = torch.Generator().manual_seed(rows)
    hidden, inter = 100, 150  # not multiples of the tiles: masked edges in k and n
    x = torch.randn(rows, hidden, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(2 * inter, hidden, generator=g) / 10).to(device=device, dtype=dtype)
    got = gate_up_silu_triton(x, weight)
    assert got.shape == (rows, inter) and got.dtype == dtype
    rtol, atol = GEMM_TOL[dtype] if device == "cpu" else TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), gate_up_silu_reference(x, weight).float().cpu(), rtol=rtol,
                               atol=atol)


def test_kernels_refuse_bad_shapes():
    with pytest.raises(ValueError, match="x must match residual"):
        add_rms_norm_triton(torch.randn(2, 5), torch.randn(2, 4), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="rows must be"):
        add_rms_norm_triton(None, torch.randn(2, 4), torch.ones(4), 1e-5, rows=torch.zeros(2))
    with pytest.raises(ValueError, match="rows must be"):
        add_rms_norm_triton(None, torch.randn(2, 4), torch.ones(4), 1e-5, rows=torch.zeros(4, dtype=torch.long)[::2])
    with pytest.raises(ValueError, match="expected gate"):
        silu_mul_triton(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(ValueError, match="gate-up weight"):
        gate_up_silu_triton(torch.randn(2, 4), torch.randn(5, 4))
    with pytest.raises(TypeError, match="one dtype"):
        gate_up_silu_triton(torch.randn(2, 4), torch.randn(6, 4).double())
    q, kv, cos = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(8, 8)
    cache, pos = torch.randn(4, 1, 8), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="expected q"):
        rotary_kv_triton(q, kv, kv, pos, cos, cos, cache[:, :, :4], cache, pos)
    with pytest.raises(TypeError, match="one dtype"):
        rotary_kv_triton(q, kv, kv, pos, cos, cos, cache.double(), cache.double(), pos)
    with pytest.raises(ValueError, match="must be contiguous"):
        rotary_kv_triton(q, kv, kv, torch.zeros(4, dtype=torch.long)[::2], cos, cos, cache, cache, pos)


def test_fuse_linears_views_one_copy_and_leaves_packed_alone():
    torch.manual_seed(0)
    qkv = [nn.Linear(8, n, bias=True) for n in (8, 4, 4)]
    x = torch.randn(3, 8)
    want = [m(x) for m in qkv]
    weight, bias = fuse_linears(qkv)
    assert weight.shape == (16, 8) and bias.shape == (16,)
    assert all(is_fused_view(m, weight) for m in qkv)  # one copy of the weights in memory
    got = torch.nn.functional.linear(x, weight, bias).split([8, 4, 4], dim=1)
    for a, b, m in zip(got, want, qkv):
        assert a.equal(b) or torch.allclose(a, b, rtol=0, atol=1e-6)
        assert m(x).equal(b)  # the unfused layer still computes the same
    assert fuse_linears([nn.Linear(8, 4), nn.Linear(8, 4, bias=False)]) is None  # mixed biases
    assert fuse_linears([nn.Linear(8, 4), nn.Linear(6, 4)]) is None  # different inputs
    from slipstream.models.kernels.cpu_linear import PackedLinear, onednn_available

    if onednn_available():
        packed = [PackedLinear(torch.randn(4, 8)), PackedLinear(torch.randn(4, 8))]
        assert fuse_linears(packed) is None

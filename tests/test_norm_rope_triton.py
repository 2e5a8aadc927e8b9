"""The Triton RMSNorm and rotary kernels against llama.py's reference ops: interpreted on CPU
tensors here, compiled in the `cuda` tests. Fresh random inputs per case; outputs are poisoned
first so an unwritten element shows."""
import pytest
import torch

pytest.importorskip("triton")

from slipstream.models.config import tiny_config  # noqa: E402
from slipstream.models.llama import RMSNorm, RotaryEmbedding, rotate_half_reference  # noqa: E402
from slipstream.models.norm_rope_triton import rms_norm_triton, rotary_triton  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: reduction order only; bf16/fp16: one rounding of the output in the last place at most
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-3)}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _device(name):
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    return name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (33, 100)])
def test_rms_norm_matches_reference(device, dtype, rows, hidden):
    device = _device(device)
    g = torch.Generator().manual_seed(rows * 1000 + hidden)
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    norm = norm.to(device=device, dtype=dtype)
    x = (3 * torch.randn(rows, hidden, generator=g)).to(device=device, dtype=dtype)
    want = norm(x)
    got = rms_norm_triton(x, norm.weight, norm.eps)
    assert got.dtype == dtype and got.shape == x.shape and torch.isfinite(got).all()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("tokens,heads,kv_heads", [(1, 9, 3), (5, 4, 4), (17, 2, 1)])
def test_rotary_matches_reference_in_place(device, dtype, tokens, heads, kv_heads):
    device = _device(device)
    cfg = tiny_config()
    rope = RotaryEmbedding(cfg).to(device)
    d = cfg.head_dim
    g = torch.Generator().manual_seed(tokens * 100 + heads)
    positions = torch.randint(0, 1024, (tokens,), generator=g).to(device)  # (bf16 tolerance set for these)
    q = torch.randn(tokens, heads, d, generator=g).to(device=device, dtype=dtype)
    k = torch.randn(tokens, kv_heads, d, generator=g).to(device=device, dtype=dtype)
    want_q, want_k = rope.for_positions(positions, dtype)(q.clone(), k.clone())
    got_q, got_k = rotary_triton(q, k, positions, rope.cos, rope.sin)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got_q.float(), want_q.float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(got_k.float(), want_k.float(), rtol=rtol, atol=atol)


def test_rotary_fused_path_is_what_the_model_uses():
    rope = RotaryEmbedding(tiny_config())
    positions = torch.tensor([0, 3, 5])
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    want = rope.for_positions(positions, torch.float32)(q.clone(), k.clone())
    rope.fused = True
    got = rope.for_positions(positions, torch.float32)(q, k)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert rotate_half_reference(q, torch.ones(1), torch.zeros(1)).equal(q)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="expected x"):
        rms_norm_triton(torch.randn(2, 3, 4), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="expected x"):
        rms_norm_triton(torch.randn(2, 4), torch.ones(5), 1e-5)
    cos = torch.randn(8, 6)
    with pytest.raises(ValueError, match="expected q"):
        rotary_triton(torch.randn(2, 1, 6), torch.randn(3, 1, 6), torch.zeros(2, dtype=torch.long), cos, cos)
    with pytest.raises(ValueError, match="expected q"):
        rotary_triton(torch.randn(2, 1, 6), torch.randn(2, 1, 6), torch.zeros(2, dtype=torch.long), cos[:, :4], cos)


def test_clear_error_without_triton(monkeypatch):
    from slipstream.models import triton_jit

    monkeypatch.setattr(triton_jit, "triton", None)
    with pytest.raises(RuntimeError, match="rms_norm_triton needs the `triton` package"):
        rms_norm_triton(torch.randn(2, 4), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="rotary_triton needs the `triton` package"):
        rotary_triton(torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.zeros(1, dtype=torch.long), torch.ones(2, 4),
                      torch.ones(2, 4))

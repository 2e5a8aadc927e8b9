"""The split-K GEMV (gemv_splitk_triton.py) against float64 (interpreted on CPU tensors here, compiled in
the `cuda` test): rows 1, 3, 8, 16, N not a multiple of the column tile, K with a masked tail, split
1 (one launch), 2 and 3 (partials + the ordered reduction), into a poisoned output."""
import pytest
import torch

pytest.importorskip("triton")

from slipstream.models.kernels import gemv_splitk_triton as gs  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}  # bf16: one rounding of the fp32 sum


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("rows,split,block_n", [(1, 1, 8), (3, 2, 4), (8, 3, 8), (16, 2, 16)])
def test_matches_float64_into_a_poisoned_output(device, dtype, rows, split, block_n):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    g = torch.Generator().manual_seed(100 * rows + split)
    k, n = 300, 37  # a masked K tail and a partial last column tile
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    out = torch.full((rows, n), float("nan"), dtype=dtype)
    got = gs.gemv_splitk_triton(x.to(device), w.to(device), block_n=block_n, split=split, out=out.to(device))
    want = x.double() @ w.double().T
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.double().cpu(), want, rtol=rtol, atol=atol)


def test_the_split_is_deterministic_and_shapes_are_checked():
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(2, 200, generator=g), torch.randn(24, 200, generator=g)
    a, b = gs.gemv_splitk_triton(x, w, split=3), gs.gemv_splitk_triton(x, w, split=3)
    assert torch.equal(a, b)
    assert gs.gemv_splitk_triton(x[:, :0], w[:, :0]).eq(0).all()  # K = 0: zeros, not garbage
    with pytest.raises(ValueError, match="at most"):
        gs.gemv_splitk_triton(torch.randn(gs.MAX_ROWS + 1, 200), w)
    with pytest.raises(ValueError, match="power of two"):
        gs.gemv_splitk_triton(x, w, block_n=6)
    with pytest.raises(TypeError):
        gs.gemv_splitk_triton(x, w.double())


def test_launch_slices_cover_k_in_whole_chunks():
    for rows, k, block_n, split in ((1, 2048, 8, 4), (8, 8192, 8, 3), (3, 300, 4, 2), (2, 64, 8, 2)):
        cfg = gs.gemv_launch(rows, k, block_n, split)
        assert cfg["k_per_split"] % cfg["BLOCK_K"] == 0 and gs.cdiv(k, cfg["k_per_split"]) == split  # honoured
        assert cfg["BLOCK_M"] * block_n * cfg["BLOCK_K"] <= 8192 or cfg["BLOCK_K"] == 16

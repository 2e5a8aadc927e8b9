"""The CUDA path's quantized matmul (Triton, the weights expanded in the K loop) against dequantize-then-
matmul, per format, interpreted on CPU tensors here and compiled in the `cuda` tests; and the embedding
rows gathered without a host sync."""
import pytest
import torch
from quant_util import FORMATS, random_weight

pytest.importorskip("triton")

from slipstream.models.quant_triton import quant_matmul_triton, quant_rows_triton  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
# float32: order of summation (IEEE dots, no TF32); bfloat16: the weights rounded to bfloat16 as a
# dequantized bfloat16 model holds them, and one rounding of the output (2^-8 relative)
TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", FORMATS)
def test_matches_dequantize_then_matmul(device, dtype, name):
    w = random_weight(name, 37, 256).map(lambda t: t.to(device))  # a last, partial panel
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(7)).to(device=device, dtype=dtype)
    y = quant_matmul_triton(x, w)
    assert y.shape == (5, 37) and y.dtype == dtype
    ref = x.double() @ w.dequantize().to(dtype).double().T
    assert (y.double() - ref).abs().max().item() <= TOL[dtype] * ref.abs().max().item()


@pytest.mark.parametrize("device", DEVICES)
def test_rows_are_exact(device):
    w = random_weight("Q6_K", 40, 256).map(lambda t: t.to(device))
    ids = torch.tensor([39, 0, 21, 21], device=device)
    assert torch.equal(quant_rows_triton(w, ids), w.dequantize()[ids])

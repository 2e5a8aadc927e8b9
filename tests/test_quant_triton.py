"""The CUDA path's quantized matmul (Triton, the weights expanded in the K loop) against dequantize-then-
matmul, per format, interpreted on CPU tensors here and compiled in the `cuda` tests; and the embedding
rows gathered without a host sync."""
import pytest
import torch
from quant_util import FORMATS, random_weight

pytest.importorskip("triton")

from slipstream.models.kernels.quant_triton import quant_matmul_triton, quant_rows_triton  # noqa: E402

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


def quantized_tiny(dtype, device):
    """tiny-random with every matrix quantized (Q4_1 projections, Q8_0 embedding), built as the loader
    builds a GGUF's model, and its dequantized twin."""
    import gguf

    from slipstream.models.llama.build import random_weights
    from slipstream.models.config import tiny_config
    from slipstream.models.llama.model import LlamaForCausalLM
    from slipstream.models.kernels.quant_formats import repack

    cfg = tiny_config()
    weights = {}
    for name, t in random_weights(cfg, 0).items():
        if t.dim() == 2 and name != "lm_head.weight":
            fmt = "Q8_0" if "embed" in name else "Q4_1"
            raw = gguf.quants.quantize(t.numpy(), gguf.GGMLQuantizationType[fmt])
            weights[name] = repack(fmt, raw, t.shape[1])
        elif name != "lm_head.weight":
            weights[name] = t
    quant = LlamaForCausalLM.from_quantized(cfg, weights, dtype, device)
    dense = {k: v.dequantize() if hasattr(v, "dequantize") else v for k, v in weights.items()}
    return cfg, quant, LlamaForCausalLM.from_weights(cfg, dense, dtype, device)


@pytest.mark.filterwarnings(r"ignore:(overflow|invalid value) encountered:RuntimeWarning")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_quantized_model_on_the_triton_backend(device, dtype, monkeypatch):
    """What CUDA runs for a GGUF kept quantized: the triton backend with QuantLinear / QuantEmbedding
    layers (products in quant_matmul_triton, here interpreted: the CPU's compiled kernels are swapped
    out), against the dequantized model on the reference backend."""
    from triton_model_util import two_steps

    from slipstream.models.kernels import quant_linear

    if device == "cpu":
        monkeypatch.setattr(quant_linear, "cpu_matmul",
                            lambda x, w, invariant=False, lib=None, activations="float": quant_matmul_triton(x.contiguous(), w))
        monkeypatch.setattr(quant_linear, "cpu_rows", lambda w, ids, lib=None: quant_rows_triton(w, ids))
    cfg, quant, dense = quantized_tiny(dtype, device)
    quant.set_kernel_backend("triton")
    tol = {torch.float32: 2e-5, torch.bfloat16: 0.15}[dtype]  # as tests/test_fused_model.py
    for got, want in zip(two_steps(quant, cfg, dtype, device), two_steps(dense, cfg, dtype, device)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=0, atol=tol)

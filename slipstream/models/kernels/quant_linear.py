"""Linear and embedding layers whose weights stay quantized (models/kernels/quant_formats.py).

On the CPU the product runs in the compiled kernels (quant_matmul_cpu.c, loaded by cpu_kernels.py):
float32 activations times the weights expanded group by group in registers, never to a float matrix
in memory. On CUDA it runs in Triton kernels that expand the weights in the GEMM's inner loop
(quant_triton.py). Elsewhere, or without the compiled kernels, `reference_matmul` expands the
weights to float in chunks of rows and multiplies: correct, and far slower (build.py loads a
dequantized model instead when the compiled kernels are missing on the CPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.models.kernels.cpu_kernels import check_rc
from slipstream.models.kernels.quant_formats import QuantWeight

_KIND = {"u4": 0, "i8": 1}
REFERENCE_CHUNK_PANELS = 256  # panels (of 16 rows) expanded at a time by the reference path


def ptr_or_none(t: torch.Tensor | None) -> int | None:
    """A tensor's address for ctypes, None (NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def _chunks(w: QuantWeight):
    p = w.values.shape[0]
    return (w.panels(i, min(p, i + REFERENCE_CHUNK_PANELS)) for i in range(0, p, REFERENCE_CHUNK_PANELS))


def reference_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [M, K] @ W^T in float32 through dequantised row chunks (the fallback, and tests' reference)."""
    parts = [F.linear(x.float(), c.dequantize()) for c in _chunks(w)]
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


# EngineConfig.activations -> the compiled products that round x: (u4 kernel, i8 kernel)
_ROUNDED = {"int8": ("sq_gemm_u4_q8", "sq_gemm_i8_q8"), "int16": ("sq_gemm_u4_q16", "sq_gemm_i8_q16")}


def cpu_matmul(x: torch.Tensor, w: QuantWeight, invariant: bool = False, lib=None,
               activations: str = "float") -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, N] float32 with the compiled kernels (`lib`, default: loaded).
    `invariant`: a row's result does not depend on M (quant_matmul_cpu.c), as batch invariance needs.
    `activations` "int8" / "int16": x rounded per group and multiplied in integers
    (quant_matmul_q8_cpu.c / quant_matmul_q16_cpu.c; invariant by construction)."""
    if lib is None:
        from slipstream.models.kernels.cpu_kernels import native_kernels

        lib = native_kernels()
        if lib is None:
            return reference_matmul(x, w)
    x = x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()
    m, k = x.shape
    n = w.rows
    y = torch.empty(m, n, dtype=torch.float32)
    f16 = int(w.scales.dtype == torch.float16)
    if activations != "float":
        u4, i8 = _ROUNDED[activations]
        if w.kind == "u4":
            rc = getattr(lib, u4)(x.data_ptr(), m, k, w.values.data_ptr(), w.scales.data_ptr(),
                                  ptr_or_none(w.offsets), f16, n, y.data_ptr(), n)
        else:
            rc = getattr(lib, i8)(x.data_ptr(), m, k, w.values.data_ptr(), w.scales.data_ptr(),
                                  ptr_or_none(w.offsets), f16, w.group, n, y.data_ptr(), n)
        check_rc(rc, f"no {activations} kernel for groups of {w.group}")
    elif w.kind == "u4":
        check_rc(lib.sq_gemm_u4(x.data_ptr(), m, k, w.values.data_ptr(), w.scales.data_ptr(), ptr_or_none(w.offsets),
                                f16, n, y.data_ptr(), n, int(invariant)), "no u4 kernel")
    else:
        check_rc(lib.sq_gemm_i8(x.data_ptr(), m, k, w.values.data_ptr(), w.scales.data_ptr(), ptr_or_none(w.offsets),
                                f16, w.group, n, y.data_ptr(), n, int(invariant)),
                 f"no int8 kernel for groups of {w.group}")
    return y


def cpu_rows(w: QuantWeight, ids: torch.Tensor, lib=None) -> torch.Tensor:
    """Rows `ids` of W as float32 [len(ids), K] (an embedding lookup)."""
    if lib is None:
        from slipstream.models.kernels.cpu_kernels import native_kernels

        lib = native_kernels()
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if lib is None:
        return w.take(ids)
    k = w.cols
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    lib.sq_dequant_rows(_KIND[w.kind], w.values.data_ptr(), w.scales.data_ptr(), ptr_or_none(w.offsets),
                        int(w.scales.dtype == torch.float16), k, w.group, ids.data_ptr(), ids.numel(),
                        out.data_ptr())
    return out


def dequantize(w: QuantWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix, through the compiled kernels when loaded (no temporaries), else in torch."""
    from slipstream.models.kernels.cpu_kernels import native_kernels

    lib = native_kernels() if w.device.type == "cpu" else None
    if lib is None:
        return torch.cat([c.dequantize(dtype) for c in _chunks(w)])
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float32)
    lib.sq_dequant_rows(_KIND[w.kind], w.values.data_ptr(), w.scales.data_ptr(), ptr_or_none(w.offsets),
                        int(w.scales.dtype == torch.float16), k, w.group, None, n, out.data_ptr())
    return out.to(dtype)


class QuantLinear(nn.Module):
    """y = x @ W^T (+ b) with W a QuantWeight; y in x's dtype."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None = None, invariant: bool = False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.qweight = weight  # a plain attribute: its parts are not parameters (never trained, cast or saved)
        self.bias = None if bias is None else bias.detach()
        self.invariant = invariant  # CPU: batch-invariant results (cpu_matmul)
        self.activations = "float"  # CPU: EngineConfig.activations (cpu_matmul; LlamaForCausalLM.set_activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x.device.type == "cpu":
            y = cpu_matmul(x2, self.qweight, self.invariant, activations=self.activations)
        else:
            from slipstream.models.kernels.quant_triton import quant_matmul_triton

            y = quant_matmul_triton(x2, self.qweight)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*lead, self.out_features)

    def extra_repr(self) -> str:
        w = self.qweight
        return f"in_features={self.in_features}, out_features={self.out_features}, {w.source} as {w.kind}"


class QuantEmbedding(nn.Module):
    """Token embedding read from a QuantWeight [vocab, hidden]: only the looked-up rows are expanded."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.qweight = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type == "cpu":
            rows = cpu_rows(self.qweight, ids)
        else:
            from slipstream.models.kernels.quant_triton import quant_rows_triton

            rows = quant_rows_triton(self.qweight, ids.reshape(-1))
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qweight.source} as {self.qweight.kind}"

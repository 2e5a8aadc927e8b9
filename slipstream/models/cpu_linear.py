"""Linear layers with weights prepacked for oneDNN: the fast CPU path for float32 decode.

A decode step multiplies a handful of rows by every weight matrix, so it streams the weights from
memory once per step. torch's default CPU linear (MKL sgemm over a transposed view) reads them well
below the memory's bandwidth and slows down further past one row; oneDNN with its weights reordered
once into its blocked layout makes a decode forward 1.5–2.4× faster at batch 1 and 2× at batch 8
(docs/benchmarks.md, "CPU decode vs transformers (issue 18)"). (Fusing q/k/v
and gate/up into one matrix each was tried: within noise at batch 1 and 8, and the concatenation
costs a second copy of those weights at start, so each projection is packed as it is.)

Packing copies the weights, so `pack_weights` consumes its input dict: each dense matrix is dropped
as soon as its packed copy exists, and pages it occupied in a file mapping (a safetensors cache
entry) are handed back to the kernel at once (`release_file_pages`), so resident memory holds one
copy of the weights, not two. Only used off the batch-invariant path: invariance is calibrated
against torch's default kernels (slipstream/runtime/cpu_invariance.py).
"""
from __future__ import annotations

import ctypes
import functools
import mmap

import torch
from torch import nn

from slipstream.models.config import ModelConfig

PACKABLE_DTYPES = (torch.float32,)
_MADV_DONTNEED = 4


@functools.lru_cache(maxsize=None)
def onednn_available() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return torch.device(device).type == "cpu" and dtype in PACKABLE_DTYPES and onednn_available()


class PackedLinear(nn.Module):
    """y = x @ W.T (+ b) with W held only in oneDNN's layout (no dense copy kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not parameters: an opaque mkldnn tensor cannot be moved, cast or saved.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.bias = None if bias is None else bias.detach().contiguous().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's file-backed mappings (Linux; empty elsewhere)."""
    spans = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[4] != "0" and parts[5].startswith("/"):
                    lo, hi = parts[0].split("-")
                    spans.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return spans


def release_file_pages(t: torch.Tensor, mappings: list[tuple[int, int]]) -> None:
    """Drop the resident pages wholly inside `t` if it lives in a file mapping. Safe for any
    reader still holding the mapping: a file page dropped this way is read back from the file
    on its next touch (weights are never written). Anonymous memory is never touched."""
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    if not any(lo <= start and end <= hi for lo, hi in mappings):
        return
    page = mmap.PAGESIZE
    lo, hi = -(-start // page) * page, end // page * page
    if hi > lo:
        try:
            ctypes.CDLL(None, use_errno=True).madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
        except (OSError, AttributeError):  # no libc madvise: the pages stay until the mapping closes
            pass


def pack_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, PackedLinear]:
    """Pack every projection and the lm_head, removing the projections' dense matrices (and biases)
    from `weights` as it goes. Returns the packed layers by module name; `weights` keeps the rest
    (embedding, norms).

    A tied lm_head is packed from the embedding table, which stays dense for lookups: a second copy
    of the table, but a lookup touches only the rows of the step's tokens, so once the table's file
    pages are released (a cache entry, a safetensors folder) it costs almost no resident memory."""
    mappings = _file_mappings()
    names = [f"model.layers.{i}.{m}" for i in range(config.num_layers)
             for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                       "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    packed: dict[str, PackedLinear] = {}
    for name in names + ([] if config.tie_word_embeddings else ["lm_head"]):
        weight, bias = weights.pop(f"{name}.weight"), weights.pop(f"{name}.bias", None)
        packed[name] = PackedLinear(weight, bias)
        release_file_pages(weight, mappings)
    if config.tie_word_embeddings:
        table = weights["model.embed_tokens.weight"]
        packed["lm_head"] = PackedLinear(table)
        release_file_pages(table, mappings)
    return packed

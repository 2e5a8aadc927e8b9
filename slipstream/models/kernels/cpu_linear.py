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
against torch's default kernels (slipstream/runtime/devices/cpu_invariance.py).

oneDNN (and ideep above it) cache one primitive per input shape, 0.35–0.8 MB each (generated code
and buffers; tools/bench/bench_packed_rows.py --primitive-memory), up to 1,024 entries per cache, and a
server's steps come in every row count up to its token budget: RSS grew by ~7 MB per wave of
abandoned streams (issue 37; tools/soak/bench_rss_waves.py).
So every oneDNN call runs with a row count from a short ladder (`padded_rows`): exact up to 16
(decode batches), then four sizes per doubling up to `ROW_BLOCK`, larger inputs split into blocks of
it: 36 primitives per weight shape (~90 MB at most for SmolLM2-135M's five shapes). A row count
between two sizes is padded with zero rows up to the next, or, when that wastes more, split into the
size below plus the rest (`SPLIT_ROWS`). What that costs is measured in tools/bench/bench_packed_rows.py
(docs/benchmarks.md, issue 37).
"""
from __future__ import annotations

import ctypes
import functools
import mmap

import torch
from torch import nn
from torch.nn import functional as F

from slipstream.models.config import ModelConfig

PACKABLE_DTYPES = (torch.float32,)
_MADV_DONTNEED = 4
ROW_BLOCK = 512  # rows per oneDNN call (the default token budget); larger inputs go in blocks
EXACT_ROWS = 16
# a further call costs about as much as this many rows (each call reads all the weights; measured
# on SmolLM2-135M's shapes, one thread): split a row count when padding it wastes more
SPLIT_ROWS = 8


def _step(m: int) -> int:
    return 1 << ((m - 1).bit_length() - 3)  # a quarter of m's power of two (m > EXACT_ROWS)


def padded_rows(m: int) -> int:
    """The ladder size a call of `m` (1..ROW_BLOCK) rows runs with, padded: m up to EXACT_ROWS, then
    the next multiple of a quarter of m's power of two (17 -> 20, 33 -> 40, 129 -> 160): 36 sizes."""
    if m <= EXACT_ROWS:
        return m
    return -(-m // _step(m)) * _step(m)


def split_rows(m: int) -> int:
    """Where a call of `m` rows is split in two (0: padded, not split): after the ladder size below
    m, when the rest padded plus a call's cost is less than padding m (129 -> 128 + 1)."""
    if m <= EXACT_ROWS:
        return 0
    below = m - m % _step(m)
    rest = m - below
    return below if rest and below + padded_rows(rest) + SPLIT_ROWS < padded_rows(m) else 0


_PLANS = [(split_rows(m), padded_rows(m) - m) for m in range(ROW_BLOCK + 1)]  # m -> (cut, padding rows)


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
        self._linear = torch.ops.mkldnn._linear_pointwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self.forward(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        m = x.shape[0]
        if m <= EXACT_ROWS:  # most decode steps: as they come (the hot path, no extra op)
            return self._linear(x.contiguous(), self.packed, self.bias, "none", [], "")
        if m > ROW_BLOCK:
            return torch.cat([self.forward(x[i:i + ROW_BLOCK]) for i in range(0, m, ROW_BLOCK)])
        cut, pad = _PLANS[m]
        if cut:
            return torch.cat([self.forward(x[:cut]), self.forward(x[cut:])])
        y = self._linear(F.pad(x, (0, 0, 0, pad)) if pad else x.contiguous(), self.packed, self.bias, "none", [], "")
        return y[:m] if pad else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def file_mappings() -> list[tuple[int, int]]:
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
    mappings = file_mappings()
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

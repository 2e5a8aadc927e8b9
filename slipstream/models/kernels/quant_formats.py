"""GGUF's quantized block formats, repacked into the two layouts slipstream computes with.

A GGUF matrix [N, K] is N rows of blocks (32 or 256 weights each) that mix scales and packed integers.
The kernels read one of two containers instead, with groups along K and the rows in panels of 16:
within a panel, each position along K holds the 16 rows' values side by side, so one load is one
vector lane per output row (quant_matmul_cpu.c explains why):

    u4  per panel and group of 32 columns, 16 x 16 bytes: byte [j][r] holds row r's column j (low
        nibble) and column j + 16 (high nibble); w = scale * q + offset, q in [0, 15]   Q4_0, Q4_1, Q4_K
    i8  per panel and column, 16 int8 (one per row), groups of 32 (16 for Q6_K);
        w = scale * q (+ offset)                                  Q8_0, Q5_0, Q5_1, Q5_K, Q6_K

with one scale (and offset) per (row, group), stored [panel][group][16 rows]: float16 where the
format's own numbers are float16 and exact, float32 where a product of two of them is (the K-quants'
super-block scale times a 6- or 8-bit sub-scale). A last partial panel is padded with zero rows.
The repack is exact: `dequantize` equals gguf's own dequantisation. Q4 formats keep their size (Q4_1:
20 bytes per 32 weights either way; Q4_K: 24 instead of 18), the 5- and 6-bit formats grow to 8 bits a
weight (Q5_K 1.25 bytes instead of 0.69, Q6_K 1.25 instead of 0.82): still a quarter of float32,
and one int8 kernel serves them all. Other types (Q2_K, Q3_K, the IQ family, ...) are not repacked;
the loader dequantises them to float.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch

PANEL = 16  # rows per panel
# ggml type name -> container; the formats that stay quantized
QUANTIZED_TYPES = {"Q4_0": "u4", "Q4_1": "u4", "Q4_K": "u4",
                   "Q8_0": "i8", "Q5_0": "i8", "Q5_1": "i8", "Q5_K": "i8", "Q6_K": "i8"}
_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}  # (weights, bytes) per block


@dataclass(frozen=True)
class QuantWeight:
    """A [rows, cols] weight matrix in a repacked container (see the module docstring). Every part's
    first dimension is the panel: values u4 uint8 [P, G * 256] / i8 int8 [P, cols * 16]; scales and
    offsets [P, G * 16] (G = cols // group)."""

    kind: str  # "u4" | "i8"
    values: torch.Tensor
    scales: torch.Tensor  # float16 | float32
    offsets: torch.Tensor | None  # like scales, or None (i8 only)
    group: int  # columns per scale: 32, or 16 (Q6_K)
    source: str  # the GGUF type it came from, e.g. "Q4_1"
    rows: int
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def device(self) -> torch.device:
        return self.values.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The parts by name, as the weight cache stores them."""
        parts = {"values": self.values, "scales": self.scales}
        if self.offsets is not None:
            parts["offsets"] = self.offsets
        return parts

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def map(self, fn) -> "QuantWeight":
        """The same weight with `fn` applied to each part (a device move)."""
        return replace(self, values=fn(self.values), scales=fn(self.scales),
                       offsets=None if self.offsets is None else fn(self.offsets))

    def panels(self, lo: int, hi: int) -> "QuantWeight":
        """Rows [16 lo, 16 hi) (fewer in a last partial panel), as a weight of their own."""
        part = self.map(lambda t: t[lo:hi])
        return replace(part, rows=min(self.rows, PANEL * hi) - PANEL * lo)

    def take(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] as float32 [T, cols] (an embedding lookup): gathers, no host sync, so it runs
        on any device and inside a CUDA graph."""
        ids = ids.reshape(-1).to(torch.int64)
        t, k, gs = ids.numel(), self.cols, self.group
        g = k // gs
        p, r = ids // PANEL, ids % PANEL

        def lane(part: torch.Tensor, inner: int) -> torch.Tensor:  # [T, ..., inner, 16] -> row r's [T, ..., inner]
            v = part.index_select(0, p).view(t, -1, PANEL)
            return v.gather(2, r.view(t, 1, 1).expand(t, v.shape[1], 1)).view(t, -1, inner)

        if self.kind == "u4":
            b = lane(self.values, 16)  # [T, G, 16] bytes: columns j and j + 16
            q = torch.cat([b & 15, b >> 4], dim=2).float()
        else:
            q = lane(self.values, gs).float()
        w = q * lane(self.scales, 1).float()
        if self.offsets is not None:
            w = w + lane(self.offsets, 1).float()
        return w.reshape(t, g * gs)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [rows, cols] (computed in float32, then cast)."""
        p, k, gs = self.values.shape[0], self.cols, self.group
        g = k // gs
        if self.kind == "u4":
            v = self.values.view(p, g, 16, PANEL)  # [panel, group, column j, row]
            q = torch.stack([v & 15, v >> 4], dim=2).float()  # [p, g, half, j, row]: column 16 half + j
            q = q.permute(0, 4, 1, 2, 3).reshape(p, PANEL, g, gs)
        else:
            q = self.values.view(p, g, gs, PANEL).float().permute(0, 3, 1, 2)  # [p, row, g, column]
        per_row = lambda t: t.view(p, g, PANEL).permute(0, 2, 1)[..., None].float()  # noqa: E731
        w = q * per_row(self.scales)
        if self.offsets is not None:
            w = w + per_row(self.offsets)
        return w.reshape(p * PANEL, k)[: self.rows].to(dtype)


def _joined(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over `parts` when they lie back to back in one storage (views of a tensor that was
    split), without copying; else None."""
    first = parts[0]
    storage = first.untyped_storage()
    at = first.storage_offset()
    for p in parts:
        if (p.untyped_storage().data_ptr() != storage.data_ptr() or not p.is_contiguous()
                or p.storage_offset() != at or p.dtype != first.dtype):
            return None
        at += p.numel()
    rows = sum(p.shape[0] for p in parts)
    view: Any = torch.empty(0, dtype=first.dtype, device=first.device)  # (set_'s stubs take no untyped storage)
    return view.set_(storage, first.storage_offset(), (rows, *first.shape[1:]))


def concat(weights: list[QuantWeight]) -> QuantWeight | None:
    """One QuantWeight stacking `weights` by rows (without copying when they are adjacent views of one,
    as the weight cache hands them out), or None when they differ in container, group, scale type or
    offsets, or one but the last does not fill whole panels."""
    first = weights[0]
    same = all(w.kind == first.kind and w.group == first.group and w.cols == first.cols
               and w.scales.dtype == first.scales.dtype and (w.offsets is None) == (first.offsets is None)
               and w.device == first.device for w in weights)
    if not same or any(w.rows % PANEL for w in weights[:-1]):
        return None

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        joined = _joined(parts)
        return torch.cat(parts) if joined is None else joined

    return QuantWeight(first.kind, cat([w.values for w in weights]), cat([w.scales for w in weights]),
                       None if first.offsets is None else cat([cast(torch.Tensor, w.offsets) for w in weights]),
                       first.group,
                       first.source, sum(w.rows for w in weights), first.cols)


def split(fused: QuantWeight, rows: list[int]) -> list[QuantWeight]:
    """`fused` cut back into weights of `rows` rows each (views; every part but the last whole panels)."""
    out, at = [], 0
    for n in rows:
        panels = -(-n // PANEL)
        out.append(fused.panels(at, at + panels))
        at += panels
    return out


def _panelize(kind: str, q: np.ndarray, scales: np.ndarray, offsets: np.ndarray | None, group: int,
              source: str) -> QuantWeight:
    """Row-major values [N, K] (in [0, 15] for u4) and per-group scales/offsets [N, K // group] ->
    the panel layout."""
    n, k = q.shape
    p = -(-n // PANEL)

    def pad(a: np.ndarray) -> np.ndarray:
        return a if p * PANEL == n else np.concatenate([a, np.zeros((p * PANEL - n, a.shape[1]), a.dtype)])

    g = k // group
    if kind == "u4":  # [p, row, group, half, j] -> [p, group, j, row] bytes: half 0 low, half 1 high
        b = pad(q.astype(np.uint8)).reshape(p, PANEL, g, 2, 16).transpose(0, 2, 4, 1, 3)
        values = (b[..., 0] | (b[..., 1] << 4)).reshape(p, g * 256)
    else:  # [p, row, K] -> [p, K, row]
        values = pad(q.astype(np.int8)).reshape(p, PANEL, k).transpose(0, 2, 1).reshape(p, k * PANEL)

    def per_group(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(pad(a).reshape(p, PANEL, g).transpose(0, 2, 1).reshape(p, -1)))

    return QuantWeight(kind, torch.from_numpy(np.ascontiguousarray(values)), per_group(scales),
                       None if offsets is None else per_group(offsets), group, source, n, k)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per entry along the last axis, as float16."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit sub-block scales and mins packed in 12 bytes (Q4_K, Q5_K), each [..., 8]."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    lo, hi, mix = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return sc, mn


def _low_high(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., width] -> [..., 2 * width]: all low nibbles, then all high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def repack(ggml_type: str, raw: np.ndarray, k: int) -> QuantWeight:
    """A GGUF tensor's bytes [N, K / per_block * bytes_per_block] (uint8, as gguf's reader gives
    them) as a QuantWeight. Raises KeyError for a type not in QUANTIZED_TYPES."""
    per, nbytes = _BLOCK[ggml_type]
    n = raw.shape[0]
    b = np.asarray(raw, dtype=np.uint8).reshape(n, k // per, nbytes)
    kind, group, offsets = QUANTIZED_TYPES[ggml_type], 32, None
    q: np.ndarray  # (each block format builds these its own way)
    qh: np.ndarray
    high: np.ndarray
    if ggml_type in ("Q4_0", "Q4_1"):
        d = _f16(b[..., 0:2])
        q = _low_high(b[..., 4 if ggml_type == "Q4_1" else 2:])
        if ggml_type == "Q4_1":
            scales, offsets = d, _f16(b[..., 2:4])
        else:  # w = d * (q - 8): the offset -8d is exact in float16 unless it overflows
            off = -8.0 * d.astype(np.float32)
            exact = np.all(np.isfinite(off) | ~np.isfinite(d))
            scales, offsets = (d, off.astype(np.float16)) if exact else (d.astype(np.float32), off)
    elif ggml_type == "Q8_0":
        scales = _f16(b[..., 0:2])
        q = b[..., 2:].view(np.int8)
    elif ggml_type in ("Q5_0", "Q5_1"):
        at = 4 if ggml_type == "Q5_1" else 2
        d = _f16(b[..., 0:2])
        qh = np.ascontiguousarray(b[..., at:at + 4]).view(np.uint32)[..., 0]  # bit j: column j's fifth bit
        high = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = _low_high(b[..., at + 4:]) | (high << 4)
        if ggml_type == "Q5_1":
            scales, offsets = d, _f16(b[..., 2:4])
        else:
            q, scales = q.astype(np.int16) - 16, d
    elif ggml_type in ("Q4_K", "Q5_K"):
        d = _f16(b[..., 0:2]).astype(np.float32)
        dmin = _f16(b[..., 2:4]).astype(np.float32)
        sc, mn = _k_scales(b[..., 4:16])
        scales = d[..., None] * sc.astype(np.float32)  # [N, blocks, 8]: exact in float32
        offsets = -(dmin[..., None] * mn.astype(np.float32))
        if ggml_type == "Q4_K":  # 4 x 32 bytes: low nibbles sub-block 2c, high nibbles 2c + 1
            q = _low_high(b[..., 16:].reshape(n, k // 256, 4, 32))
        else:
            qh = b[..., 16:48]  # bit j of byte l: sub-block j's fifth bit of column l
            low = _low_high(b[..., 48:].reshape(n, k // 256, 4, 32)).reshape(n, k // 256, 8, 32)
            high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            q = low | (high << 4)
    elif ggml_type == "Q6_K":
        ql = b[..., 0:128].reshape(n, k // 256, 2, 64)
        qh = b[..., 128:192].reshape(n, k // 256, 2, 32)
        sub = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)  # 16 sub-scales
        d = _f16(b[..., 208:210]).astype(np.float32)
        low = _low_high(ql).reshape(n, k // 256, 2, 4, 32)  # per half: 4 runs of 32
        high = (qh[:, :, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]) & 3
        q = (low | (high << 4)).astype(np.int16) - 32
        scales, group = d[..., None] * sub, 16
    else:
        raise KeyError(ggml_type)
    return _panelize(kind, np.asarray(q).reshape(n, k), np.asarray(scales).reshape(n, k // group),
                     None if offsets is None else np.asarray(offsets).reshape(n, k // group), group, ggml_type)

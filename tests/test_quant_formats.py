"""Repacking GGUF's quantized blocks is exact: every format's containers expand to what gguf's own
dequantisation gives, rows gathered by id too, and stacked weights split back into views."""
import gguf
import numpy as np
import pytest
import torch
from quant_util import FORMATS, random_blocks, random_weight

from slipstream.models.kernels.quant_formats import PANEL, concat, repack, split


@pytest.mark.parametrize("name", FORMATS)
def test_repack_is_exact(name):
    rows, cols = 37, 512  # a last, partial panel of 5 rows; two K-quant super-blocks
    raw = random_blocks(name, rows, cols)
    expect = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]).reshape(rows, cols))
    w = repack(name, raw, cols)
    assert w.shape == (rows, cols) and w.values.shape[0] == -(-rows // PANEL)
    assert torch.equal(w.dequantize(), expect)
    ids = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(w.take(ids), expect[ids])


def test_sizes_follow_the_formats():
    """Q4 formats keep their bytes per weight; 5- and 6-bit formats take one byte per weight."""
    rows, cols = 64, 1024
    per_weight = {n: random_weight(n, rows, cols).nbytes() / (rows * cols) for n in FORMATS}
    assert per_weight["Q4_1"] == 20 / 32 and per_weight["Q4_0"] == 20 / 32 and per_weight["Q8_0"] == 34 / 32
    assert per_weight["Q4_K"] == 24 / 32 and per_weight["Q6_K"] == 1 + 4 / 16 and per_weight["Q5_K"] == 1 + 8 / 32


def test_concat_and_split():
    parts = [random_weight("Q4_1", n, 64, seed=n) for n in (32, 16, 48)]
    fused = concat(parts)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    views = split(fused, [32, 16, 48])
    assert all(torch.equal(v.dequantize(), p.dequantize()) for v, p in zip(views, parts))
    again = concat(views)  # adjacent views of one tensor: joined without a copy
    assert again.values.data_ptr() == fused.values.data_ptr() and torch.equal(again.values, fused.values)
    assert concat([random_weight("Q4_1", 8, 64), parts[0]]) is None  # a partial panel in the middle
    assert concat([parts[0], random_weight("Q8_0", 16, 64)]) is None  # different containers
    assert np.isclose(sum(p.nbytes() for p in parts), fused.nbytes())

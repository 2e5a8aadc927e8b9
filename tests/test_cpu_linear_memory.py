"""The packed CPU linear path keeps a bounded set of oneDNN primitives (issue 37, item 6).

oneDNN and ideep cache a primitive (0.35–0.8 MB of generated code and buffers) per input shape; a
server sees every row count from 1 to its token budget, so without bounds RSS grew with each new
step size (tools/soak/bench_rss_waves.py)."""
import pytest
import torch

from slipstream.models.kernels.cpu_linear import ROW_BLOCK, PackedLinear, onednn_available, padded_rows, split_rows

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_every_row_count_up_to_two_blocks_costs_a_few_primitives():
    torch.manual_seed(0)
    layer = PackedLinear(torch.randn(48, 40))  # a shape no other test uses: its primitives are new
    x = torch.randn(2 * ROW_BLOCK + 100, 40)
    layer(x[:1])  # oneDNN's own start-up
    before = rss_mb()
    for m in range(2, 2 * ROW_BLOCK + 100, 3):
        layer(x[:m])
    # the ladder's 36 sizes: ~16 MB; a primitive per row count: ~180 MB
    assert rss_mb() - before < 32


def test_padding_changes_no_row():
    torch.manual_seed(1)
    w, b = torch.randn(24, 16), torch.randn(24)
    layer = PackedLinear(w, b)
    x = torch.randn(2 * ROW_BLOCK + 37, 16)
    for m in (0, 1, 5, 9, 17, 100, 129, ROW_BLOCK, ROW_BLOCK + 1, 2 * ROW_BLOCK + 37):
        got = layer(x[:m])
        assert got.shape == (m, 24)
        torch.testing.assert_close(got, x[:m] @ w.T + b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer(x[:10].view(2, 5, 16)), (x[:10] @ w.T + b).view(2, 5, 24))


def test_the_ladder_is_small_and_wastes_little():
    sizes = {padded_rows(m) for m in range(1, ROW_BLOCK + 1)}
    assert len(sizes) == 36 and max(sizes) == ROW_BLOCK
    assert all(padded_rows(m) == m for m in range(1, 17))  # small decode batches run exactly
    assert all(m <= padded_rows(m) <= m * 1.25 for m in range(17, ROW_BLOCK + 1))
    cuts = {m: split_rows(m) for m in range(1, ROW_BLOCK + 1)}
    assert cuts[129] == 128 and cuts[160] == cuts[150] == cuts[16] == 0  # 128 + 1, not 160; 150 -> 160
    assert all(padded_rows(c) == c for c in cuts.values() if c)  # a split's first part is a ladder size

"""cuBLAS or the split-K GEMV per weight shape (models/kernels/gemm_choice.py, TritonOptions.small_gemm_max_rows):
the choice follows the measurement, per shape and row count, with a margin for noise; the forward takes
the chosen kernel and computes the reference's logits (interpreted here; the `cuda` test measures)."""
import pytest
import torch

pytest.importorskip("triton")

from slipstream.models.config import tiny_config  # noqa: E402
from slipstream.models.kernels import gemm_choice as gc  # noqa: E402
from slipstream.models.llama import forward_triton as ft  # noqa: E402
from triton_model_util import build, two_steps  # noqa: E402

G8, G4 = gc.Gemv(8, 1), gc.Gemv(4, 1)


def test_pick_keeps_cublas_unless_a_gemv_beats_it_by_the_margin():
    assert gc.pick({gc.CUBLAS: 1.0, G8: 0.99, G4: 1.2}) is gc.CUBLAS  # within the margin: noise
    assert gc.pick({gc.CUBLAS: 1.0, G8: 0.5, G4: 0.6}) == G8
    assert gc.pick({gc.CUBLAS: 1.0}) is gc.CUBLAS


def test_measure_chooses_per_shape_and_row_count():
    """A fake clock on which the GEMV wins only for the wide weight at 1 row: the table says exactly that."""
    wide, narrow = torch.randn(64, 16), torch.randn(8, 16)
    ran = []

    def clock(candidate, fn):
        out = fn()
        ran.append(candidate)
        rows, n = out.shape
        return 0.5 if candidate == G8 and n == 64 and rows == 1 else 1.0

    table = gc.measure([wide, narrow, wide.clone()], [1, 2], clock)  # (the same shape twice: measured once)
    assert table == {(1, 64, 16): G8, (1, 8, 16): gc.CUBLAS, (2, 64, 16): gc.CUBLAS, (2, 8, 16): gc.CUBLAS}
    assert len(ran) == 4 * (1 + len(gc.CANDIDATES))  # every candidate, each (rows, shape) once
    with pytest.raises(ValueError, match="row counts"):
        gc.measure([wide], [17], clock)


def test_small_linear_takes_the_table_and_falls_back_to_cublas():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 40, generator=g), torch.randn(24, 40, generator=g), torch.randn(24, generator=g)
    want = torch.nn.functional.linear(x, w)
    for table in ({(2, 24, 40): gc.Gemv(8, 2)}, {}, None):
        torch.testing.assert_close(gc.small_linear(x, w, None, table), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gc.small_linear(x, w, b, {(2, 24, 40): G8}), want + b)  # a bias: cuBLAS


def test_off_by_default_and_bounded():
    assert ft.TRITON_DEFAULTS.small_gemm_max_rows == 0
    with pytest.raises(ValueError, match="small_gemm_max_rows"):
        ft.TritonOptions(small_gemm_max_rows=17)
    model = build(tiny_config(), torch.float32, "triton", ft.TritonOptions(small_gemm_max_rows=8))
    assert model.small_gemms == {}  # measured on CUDA only: the CPU keeps cuBLAS's path (F.linear)
    assert len(ft.small_gemm_weights(model)) == 3 * tiny_config().num_layers  # qkv, o_proj, down


@pytest.mark.filterwarnings(r"ignore:(overflow|invalid value) encountered:RuntimeWarning")  # padding rows
def test_the_forward_runs_the_chosen_gemv_and_keeps_the_logits(monkeypatch):
    cfg = tiny_config()
    reference = two_steps(build(cfg, torch.float32, "reference"), cfg, torch.float32, "cpu")
    model = build(cfg, torch.float32, "triton", ft.TritonOptions(small_gemm_max_rows=8))
    # both steps have 8 token rows: every projection's shape at 8 rows takes the GEMV (split 2)
    model.small_gemms = {(8, w.shape[0], w.shape[1]): gc.Gemv(8, 2) for w in ft.small_gemm_weights(model)}
    calls = []
    real = gc.gemv_splitk_triton
    monkeypatch.setattr(gc, "gemv_splitk_triton", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    got = two_steps(model, cfg, torch.float32, "cpu")
    assert len(calls) == 2 * 3 * cfg.num_layers  # two steps, three projections a layer
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r, rtol=0, atol=2e-5)


@pytest.mark.cuda
def test_measured_at_start_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    model = build(tiny_config(), torch.bfloat16, "triton", ft.TritonOptions(small_gemm_max_rows=2), device="cuda")
    shapes = {(w.shape[0], w.shape[1]) for w in ft.small_gemm_weights(model)}
    assert set(model.small_gemms) == {(r, n, k) for r in (1, 2) for n, k in shapes}

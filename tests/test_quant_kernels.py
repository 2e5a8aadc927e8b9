"""The compiled CPU kernels against torch references: the quantized matmul per format (within 1e-5 of
the output's magnitude of dequantize-then-matmul in float64), its batch-invariant mode, row lookups,
and the fused layer steps (norm, rotary + KV write, paged attention, SiLU*up)."""
import ctypes
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from quant_util import FORMATS, random_weight

from slipstream.models.kernels import cpu_kernels
from slipstream.models.kernels.attention import AttentionMetadata, paged_attention_reference
from slipstream.models.kernels.quant_linear import _ROUNDED, cpu_matmul, cpu_rows, dequantize, reference_matmul
from slipstream.models.kernels.rotary import rotate_half_reference

lib = cpu_kernels.native_kernels()
# Skipped only where there is no compiler: a build that fails where one is fails the suite
# (test_the_kernels_build_wherever_there_is_a_compiler), never skips it.
pytestmark = pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler: no compiled CPU kernels")


def test_the_kernels_build_wherever_there_is_a_compiler():
    assert lib is not None, "a C compiler is on PATH but the CPU kernels did not build (cpu_kernels_unavailable)"
TOL = 1e-5  # of max |y|: float32 accumulation over K <= 1536 (observed <= 5e-7)


def close(y, ref):
    return (y.double() - ref).abs().max().item() <= TOL * ref.abs().max().item()


@pytest.mark.parametrize("name", FORMATS)
def test_matmul_matches_dequantize_then_matmul(name):
    w = random_weight(name, 83, 512)  # 6 panels, the last partial
    ref_w = w.dequantize().double()
    g = torch.Generator().manual_seed(1)
    for m in (1, 2, 3, 8, 9, 33):
        x = torch.randn(m, 512, generator=g)
        ref = x.double() @ ref_w.T
        assert close(cpu_matmul(x, w, lib=lib), ref), m
        assert close(cpu_matmul(x, w, invariant=True, lib=lib), ref), m
    assert close(reference_matmul(x, w), ref)  # the fallback's path


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0", "Q6_K"])
def test_invariant_rows_do_not_depend_on_the_batch(name):
    w = random_weight(name, 48, 256)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(2))
    full = cpu_matmul(x, w, invariant=True, lib=lib)
    for m in range(1, 17):
        assert torch.equal(cpu_matmul(x[:m], w, invariant=True, lib=lib), full[:m]), m


# SQ_TINY_GROUP of quant_rounded_cpu.h: a group whose max |x| is below it (zero, denormal, tiny)
# rounds to all zeros with scale 0 in both rounding kernels
TINY_GROUP = 2.0 ** -111


def int8_reference(x, w):
    """What the int8-activation kernels compute, in float64: each row of x rounded to int8 per group
    (scale max|x| / 127, ties to even; 0 for a group of max|x| < TINY_GROUP) against the weights'
    integers, the offsets against exact x."""
    gs = 32 if w.kind == "u4" else w.group
    g = x.double().view(x.shape[0], -1, gs)
    amax = g.abs().amax(-1, keepdim=True)
    xq = torch.where(amax >= TINY_GROUP, torch.round(g * (127 / amax)) * (amax / 127), 0).view_as(x)
    offsets = replace(w, values=torch.zeros_like(w.values)).dequantize().double()  # q = 0: the offset
    return xq @ (w.dequantize().double() - offsets).T + x.double() @ offsets.T


@pytest.mark.parametrize("name", FORMATS)
def test_int8_activations_match_their_reference(name):
    """The int8-activation products (quant_matmul_q8_cpu.c): as int8_reference says, and a row's result
    the same bits whatever the number of rows beside it."""
    w = random_weight(name, 83, 512)  # 6 panels, the last partial
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    x[4, 32:64] = 0  # an all-zero group
    full = cpu_matmul(x, w, lib=lib, activations="int8")
    assert close(full, int8_reference(x, w))
    assert not close(full, x.double() @ w.dequantize().double().T)  # (rounded: not the float product)
    for m in (1, 5):
        assert torch.equal(cpu_matmul(x[:m], w, lib=lib, activations="int8"), full[:m]), m


def int16_reference(x, w):
    """What the int16-activation kernels compute, in float64 from the same integers: each row of x
    rounded per group to v = rint(float32(x * float32(32767 / max|x|))) (ties to even, as the kernel's
    float32 arithmetic gives them), scale max|x| / 32767 (0 and 0 for a group of max|x| < TINY_GROUP),
    against the weights' integers; the offsets against exact x."""
    gs = 32 if w.kind == "u4" else w.group
    g = x.view(x.shape[0], -1, gs)
    amax = g.abs().amax(-1, keepdim=True)
    keep = amax >= TINY_GROUP
    inv = torch.where(keep, torch.full_like(amax, 32767) / amax, 0)  # a float32 division, as in the kernel
    xq = (torch.round(g * inv).double() * torch.where(keep, amax / 32767, 0).double()).view_as(x)
    offsets = replace(w, values=torch.zeros_like(w.values)).dequantize().double()  # q = 0: the offset
    return xq @ (w.dequantize().double() - offsets).T + x.double() @ offsets.T


def portable_q16(tmp_path_factory):
    """quant_matmul_q16_cpu.c built alone with its plain C loop (SQ_Q16_PORTABLE)."""
    cc = cpu_kernels._compiler()
    out = tmp_path_factory.mktemp("q16") / "q16_portable.so"
    src = Path(cpu_kernels.__file__).with_name("quant_matmul_q16_cpu.c")
    subprocess.run([cc, *cpu_kernels.FLAGS, "-DSQ_Q16_PORTABLE", str(src), "-lm", "-o", str(out)], check=True,
                   capture_output=True, timeout=120)
    return cpu_kernels._declare(ctypes.CDLL(str(out)), ("sq_gemm_u4_q16", "sq_gemm_i8_q16", "sq_q16_vnni"))


@pytest.fixture(scope="module")
def q16_plain(tmp_path_factory):
    return portable_q16(tmp_path_factory)


@pytest.mark.parametrize("name", FORMATS)
def test_int16_activations_match_their_reference(name, q16_plain):
    """The int16-activation products (quant_matmul_q16_cpu.c): as int16_reference says (to float32
    accumulation), closer to it than to the float product, a row's result the same bits whatever the
    number of rows beside it, and the plain C loop the same bits as the vpdpwssd one."""
    w = random_weight(name, 83, 512)  # 6 panels, the last partial
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    x[4, 32:64] = 0  # an all-zero group
    x[2, 64:96] *= 1e-30  # a tiny group (scale near float32's smallest normals)
    full = cpu_matmul(x, w, lib=lib, activations="int16")
    ref, exact = int16_reference(x, w), x.double() @ w.dequantize().double().T
    err = (full.double() - ref).abs().max().item()
    assert err <= 1e-6 * ref.abs().max().item()
    assert err < (ref - exact).abs().max().item() / 4  # (rounded: what the kernel computes is not the float product)
    for m in (1, 5):
        assert torch.equal(cpu_matmul(x[:m], w, lib=lib, activations="int16"), full[:m]), m
    assert q16_plain.sq_q16_vnni() == 0
    assert torch.equal(cpu_matmul(x, w, lib=q16_plain, activations="int16"), full)


def tiny_group_rows(k: int = 512) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Rows of normal groups beside groups whose max |x| is zero, denormal (1e-40), tiny (1e-36, 1e-35),
    just below TINY_GROUP or at it; a row of denormals alone. Returns x and the (row, group of 16) that
    round to zero."""
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(7))
    small = [(0, 1, 0.0), (0, 4, 1e-40), (1, 2, 1e-36), (1, 3, 1e-35), (2, 0, TINY_GROUP * 0.99),
             (2, 6, 1.4e-45), (3, 5, 1e-36)]  # (row, group of 32, max |x|)
    for row, g, amax in small:
        part = torch.randn(32, generator=torch.Generator().manual_seed(row * 100 + g))
        x[row, g * 32:(g + 1) * 32] = (part / part.abs().max() * amax).float()
    x[3, 7 * 32:8 * 32] = TINY_GROUP  # at the bound: rounded as usual
    x[4] = 1e-40  # a row of denormals
    zero = [(r, 2 * g + h) for r, g, _ in small for h in (0, 1)] + [(4, g) for g in range(k // 16)]
    return x, zero


@pytest.mark.parametrize("mode", ["int8", "int16"])
@pytest.mark.parametrize("name", FORMATS)
def test_zero_denormal_and_tiny_groups_round_to_zero(name, mode):
    """A group whose max |x| is below TINY_GROUP rounds to zeros with scale 0, as the exact models say;
    no inf or NaN anywhere (32767 / max|x| and 127 / max|x| overflow for the denormal and tiny groups,
    rounding that inf to an int is undefined: issue 48, item 8), and such a group adds nothing."""
    w = random_weight(name, 40, 512)
    x, zero = tiny_group_rows()
    y = cpu_matmul(x, w, lib=lib, activations=mode)
    assert torch.isfinite(y).all()
    ref = (int8_reference if mode == "int8" else int16_reference)(x, w)
    assert torch.isfinite(ref).all()
    assert (y.double() - ref).abs().max().item() <= 1e-6 * ref.abs().max().item()
    cleared = x.clone()
    gs = 16  # (the groups listed are of 16; a group of 32 is two of them)
    for r, g in zero:
        cleared[r, g * gs:(g + 1) * gs] = 0
    if w.offsets is None:  # (with offsets, exact x meets them: the tiny sums are absorbed but not zero)
        assert torch.equal(cpu_matmul(cleared, w, lib=lib, activations=mode), y)
        assert torch.equal(y[4], torch.zeros_like(y[4]))
    else:
        assert torch.equal(cpu_matmul(cleared[:4], w, lib=lib, activations=mode), y[:4])


@pytest.fixture(scope="module")
def rounding_ubsan(tmp_path_factory):
    """quant_matmul_q8_cpu.c and quant_matmul_q16_cpu.c built with UBSan's float-cast-overflow check
    (unoptimized: a second to build), or skip where the compiler cannot."""
    cc = cpu_kernels._compiler()
    out = tmp_path_factory.mktemp("ubsan") / "rounding_ubsan.so"
    here = Path(cpu_kernels.__file__).parent
    done = subprocess.run([cc, "-O0", "-march=native", "-shared", "-fPIC", "-std=gnu11",
                           "-fsanitize=float-cast-overflow", str(here / "quant_matmul_q8_cpu.c"),
                           str(here / "quant_matmul_q16_cpu.c"), "-lm", "-o", str(out)],
                          capture_output=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"no float-cast-overflow sanitizer here: {done.stderr.decode()[-300:]}")
    try:
        return cpu_kernels._declare(ctypes.CDLL(str(out)), tuple(n for pair in _ROUNDED.values() for n in pair))
    except OSError as exc:
        pytest.skip(f"the sanitizer's runtime does not load here: {exc}")


def test_rounding_kernels_convert_no_out_of_range_float(rounding_ubsan, capfd):
    """Under UBSan every float -> int conversion of the rounding kernels is in range on zero,
    denormal and tiny groups (before: `inf is outside the range of representable values of type 'int'`)."""
    x, _ = tiny_group_rows()
    for name in ("Q4_1", "Q8_0", "Q6_K"):  # u4; i8 in groups of 32 and of 16
        w = random_weight(name, 16, 512)
        for mode in ("int8", "int16"):
            y = cpu_matmul(x, w, lib=rounding_ubsan, activations=mode)
            assert torch.isfinite(y).all()
    err = capfd.readouterr().err
    assert "runtime error" not in err, err


@pytest.mark.parametrize("name", FORMATS)
def test_rows_and_dequantize_are_exact(name):
    w = random_weight(name, 37, 256)
    ids = torch.tensor([0, 36, 17, 17, 3])
    assert torch.equal(cpu_rows(w, ids, lib=lib), w.dequantize()[ids])
    assert torch.equal(dequantize(w), w.dequantize())


def test_add_rms_norm():
    g = torch.Generator().manual_seed(3)
    x, delta, w = torch.randn(5, 96, generator=g), torch.randn(5, 96, generator=g), torch.randn(96, generator=g)
    summed = x + delta
    ref = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    out = torch.empty(2, 96)
    rows = torch.tensor([4, 1])
    lib.sq_add_rms_norm(x.data_ptr(), delta.data_ptr(), w.data_ptr(), 1e-5, out.data_ptr(), 5, 96, rows.data_ptr(), 2)
    assert torch.equal(x, summed)  # the residual is updated in place
    torch.testing.assert_close(out, ref[rows], rtol=1e-5, atol=1e-6)


def test_rotary_kv_and_attention_match_the_reference():
    """Two sequences, GQA (4 heads over 2): a 5-token prompt chunk after 3 cached tokens, and a decode
    token after 20; rotary, the KV writes and the causal attention as the reference path does them."""
    g = torch.Generator().manual_seed(4)
    hq, hk, d, ps = 4, 2, 48, 4  # d: a rotary half of 24, past one vector of 16
    positions = torch.tensor([3, 4, 5, 6, 7, 20])
    pages = [[5, 2], [1, 7, 3, 9, 4, 6]]
    kv_idx = torch.tensor([pages[0][p // ps] * ps + p % ps for p in range(3, 8)] + [pages[1][5] * ps + 0])
    qkv = torch.randn(6, (hq + 2 * hk) * d, generator=g)
    cos_t, sin_t = torch.randn(32, d, generator=g), torch.randn(32, d, generator=g)
    k_cache, v_cache = torch.randn(40, hk, d, generator=g), torch.randn(40, hk, d, generator=g)
    q, k, v = (part.reshape(6, -1, d) for part in qkv.split([hq * d, hk * d, hk * d], dim=1))
    cos, sin = cos_t[positions].unsqueeze(1), sin_t[positions].unsqueeze(1)
    ref_q, ref_k = rotate_half_reference(q, cos, sin), rotate_half_reference(k, cos, sin)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    ref_kc[kv_idx], ref_vc[kv_idx] = ref_k, v
    meta = AttentionMetadata([0, 5, 6], [8, 21], pages, ps)
    ref_out = paged_attention_reference(ref_q, ref_kc, ref_vc, meta, torch.zeros_like(ref_q))

    w = qkv.stride(0)
    lib.sq_rotary_kv(qkv.data_ptr(), qkv[:, hq * d:].data_ptr(), qkv[:, (hq + hk) * d:].data_ptr(), w, w, w,
                     positions.data_ptr(), cos_t.data_ptr(), sin_t.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                     kv_idx.data_ptr(), 6, hq, hk, d)
    torch.testing.assert_close(qkv[:, :hq * d].view(6, hq, d), ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_cache, ref_kc, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_cache, ref_vc)
    table = torch.tensor([p + [0] * (6 - len(p)) for p in pages])
    qs, lens = torch.tensor([0, 5, 6]), torch.tensor([8, 21])
    out = torch.zeros(6, hq * d)
    assert lib.sq_attention(qkv.data_ptr(), w, k_cache.data_ptr(), v_cache.data_ptr(), qs.data_ptr(), lens.data_ptr(),
                            table.data_ptr(), 6, ps, 2, hq, hk, d, d ** -0.5, 0, out.data_ptr()) == 0
    torch.testing.assert_close(out.view(6, hq, d), ref_out, rtol=1e-4, atol=1e-5)


def test_silu_mul():
    gu = torch.randn(3, 2 * 64, generator=torch.Generator().manual_seed(5)) * 6  # exp over a wide range
    out = torch.empty(3, 64)
    lib.sq_silu_mul(gu.data_ptr(), 128, gu[:, 64:].data_ptr(), 128, out.data_ptr(), 3, 64)
    torch.testing.assert_close(out, F.silu(gu[:, :64]) * gu[:, 64:], rtol=2e-6, atol=1e-6)


def test_no_compiler_means_no_kernels_and_a_dequantized_model(monkeypatch, tmp_path):
    """Without the kernels (no compiler here) the quantized CPU path is off: native_kernels() says
    so once, and a GGUF loads dequantized instead (models/llama/build.py)."""
    from structlog.testing import capture_logs

    from slipstream.models.llama import build

    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))  # no library built here yet
    cpu_kernels.native_kernels.cache_clear()
    try:
        with capture_logs() as logs:
            assert cpu_kernels.native_kernels() is None
            assert not build.quantized_source("smollm2-135m", torch.device("cpu"))
        assert [e["event"] for e in logs] == ["cpu_kernels_unavailable", "weights_dequantized"]
    finally:
        cpu_kernels.native_kernels.cache_clear()


def test_a_compiler_without_openmp_builds_single_threaded_kernels(monkeypatch, tmp_path):
    """Apple's clang refuses -fopenmp: the build is retried without it (one thread, same results)."""
    import shutil

    cc = tmp_path / "cc-no-openmp"
    gcc = shutil.which("gcc") or "cc"
    # -O0 in place of -O3: what is tested is the retry, and an unoptimised build takes a tenth of the time
    cc.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && exit 1; done\n'
                  f'for a in "$@"; do shift; [ "$a" = -O3 ] && a=-O0; set -- "$@" "$a"; done\nexec {gcc} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    cpu_kernels.native_kernels.cache_clear()
    try:
        single = cpu_kernels.native_kernels()
        assert single is not None and single.sq_max_threads() == 1
        w = random_weight("Q4_1", 32, 256)
        x = torch.randn(3, 256)
        assert close(cpu_matmul(x, w, lib=single), x.double() @ w.dequantize().double().T)
    finally:
        cpu_kernels.native_kernels.cache_clear()

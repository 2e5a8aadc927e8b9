"""The thin launcher on a GPU (triton_launch.py): launched thinly, the eager forward of decode and mixed
steps is bitwise the forward Triton launches, and a kernel first compiled for aligned pointers is
never reused for unaligned ones. The key logic itself is checked on the CPU (tests/test_triton_launch.py)."""
import asyncio

import pytest
import torch

pytest.importorskip("triton")

from test_mixed_graphs_cuda import _cuda_steps  # noqa: E402

from slipstream.models.kernels import triton_jit, triton_launch  # noqa: E402
from slipstream.models.kernels.silu_mul_triton import (_silu_mul_kernel, silu_mul_reference,  # noqa: E402
                                                       silu_mul_triton)


def _needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")


def _eager(dtype, thin: bool):
    triton_launch.set_enabled(thin)
    try:
        return asyncio.run(_cuda_steps(dtype=dtype, mixed_graphs=False, cuda_graphs=False))
    finally:
        triton_launch.set_enabled(False)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_thin_launches_give_bitwise_the_same_steps(dtype):
    """The mixed/prefill and decode-only steps of tests/test_mixed_graphs.py, all eager: logits, row
    tables and the KV cache. Twice thin: the first run's launches mostly compile or miss, the second's hit."""
    _needs_gpu()
    want, t_want, kv_want, _ = _eager(dtype, thin=False)
    again = _eager(dtype, thin=False)[0]  # bitwise is only a fair test of an eager path that repeats bitwise
    assert all(torch.equal(w, a) for w, a in zip(want, again)), "the eager steps differ run to run without it"
    for _ in range(2):
        before = sum(k.hits for k in triton_jit._THIN.values())
        got, t_got, kv_got, _ = _eager(dtype, thin=True)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g)
        for name in t_want:
            assert torch.equal(t_got[name], t_want[name]), name
        assert all(torch.equal(a, b) for a, b in zip(kv_got, kv_want))
    assert sum(k.hits for k in triton_jit._THIN.values()) > before > 0
    assert all(k.fallbacks == 0 for k in triton_jit._THIN.values())


@pytest.mark.cuda
def test_cuda_unaligned_pointers_get_their_own_kernel():
    _needs_gpu()
    big = torch.randn(4, 1 + 512 + 16, dtype=torch.bfloat16, device="cuda")
    aligned, unaligned = big[:, 16:16 + 256], big[:, 1:1 + 256]  # 32 bytes in; 2 bytes in
    triton_launch.set_enabled(True)
    try:
        for x in (aligned, aligned, unaligned, unaligned, aligned):
            got = silu_mul_triton(x, x)
            torch.testing.assert_close(got, silu_mul_reference(x, x), rtol=1e-2, atol=1e-2)
        torch.cuda.synchronize()
    finally:
        triton_launch.set_enabled(False)
    thin = triton_jit._THIN[_silu_mul_kernel]
    assert len(thin.entries) >= 2 and thin.hits >= 2

"""The thin launcher (slipstream/models/kernels/triton_launch.py) on the CPU.

Its key must be at least as fine as Triton's: checked against Triton's own specialisation
(`native_specialize_impl`, what the binder calls per argument) for edge values of every argument
kind, with the triton installed here and, in a subprocess, the GPU image's triton; and end to end
against `JITFunction.run` under a stand-in driver (tools/profile/bench_triton_launch.py): every launch, thin
or not, must run the compiled kernel Triton itself would pick, with the same arguments. The CUDA
check (bitwise-equal forwards) is tests/test_triton_launch_cuda.py.
"""
import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "profile"))

from slipstream.models.kernels import triton_jit, triton_launch  # noqa: E402
from slipstream.models.kernels.triton_launch import NotThin, ThinKernel, make_keyer  # noqa: E402

tl = triton.language


class OnGpu(torch.Tensor):
    """A CPU tensor the thin key takes for a CUDA one (the key refuses host tensors)."""
    is_cuda = property(lambda self: True)


def edge_values() -> list:
    ints = [0, 1, 2, 15, 16, 17, 48, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
            -2**31 - 16, 2**40, 2**40 + 1, 2**63 - 16, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 16, 2**64 - 1, 2**64]
    tensors = []
    for dtype in (torch.bfloat16, torch.float32, torch.int32, torch.int64):
        base = torch.zeros(64, dtype=dtype)
        tensors += [base[i:].as_subclass(OnGpu) for i in range(0, 9)]  # offsets: aligned and not
    return ints + tensors + [True, False, 0.5, 1.0, None]


def key_of(v):
    try:
        return type(v), make_keyer((type(v),))(v)[0]
    except NotThin:
        return NotThin


def check_against_triton() -> int:
    """Pairs of values the thin key calls equal get one specialisation from Triton; returns the pairs."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    def spec(v):
        try:
            return native_specialize_impl(BaseBackend, v, False, True, True)
        except OverflowError:
            return OverflowError

    values, pairs = edge_values(), 0
    keys, specs = [key_of(v) for v in values], [spec(v) for v in values]
    for i, j in itertools.product(range(len(values)), repeat=2):
        if keys[i] is NotThin:  # refused: Triton's own path, which raises where it must
            assert specs[i] is OverflowError or not isinstance(values[i], int), values[i]
            continue
        if keys[i] == keys[j]:
            pairs += 1
            assert specs[i] == specs[j], (values[i], values[j], keys[i], specs[i], specs[j])
    # and the key is not needlessly fine: aligned tensors of one dtype share one, as do i32 multiples of 16
    a = torch.zeros(64, dtype=torch.bfloat16)
    assert key_of(a[8:].as_subclass(OnGpu)) == key_of(a[16:].as_subclass(OnGpu)) != key_of(a[1:].as_subclass(OnGpu))
    assert key_of(32) == key_of(4096) != key_of(33)
    return pairs


def test_key_never_joins_what_triton_specialises_apart():
    assert check_against_triton() > len(edge_values())


def test_key_against_the_gpu_image_triton():
    from test_kernels_compile import GPU_IMAGE_TRITON, gpu_image_triton
    folder = gpu_image_triton()
    if folder is None:
        pytest.skip(f"the installed triton is {GPU_IMAGE_TRITON}: the test above checked it")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]))
    run = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"triton {GPU_IMAGE_TRITON}:" in run.stdout


def test_int_codes_and_keyer_agree():
    # the keyers inline the i32 case; int_code is the whole rule
    for v in [0, 1, 16, 17, -16, 2**31 - 1, 2**31, 2**63, 2**64 - 16]:
        assert make_keyer((int,))(v)[0] == (triton_launch.int_code(v),)
    with pytest.raises(NotThin):
        make_keyer((int,))(2**64)
    with pytest.raises(NotThin):
        make_keyer((torch.Tensor,))(torch.zeros(2))  # a host tensor never reaches a kernel as a pointer
    assert make_keyer((tuple,)) is None


def test_host_helpers_match_triton():
    for n in range(0, 2049):
        assert triton_jit.next_power_of_2(n) == triton.next_power_of_2(n)
        assert triton_jit.cdiv(n, 7) == triton.cdiv(n, 7) and triton_jit.cdiv(n, 64) == triton.cdiv(n, 64)


# --- end to end against JITFunction.run, under a stand-in driver ---------------------------------------

def _kernel(X, Y, n, scale, flag, stride, BLOCK: tl.constexpr, HAS_Y: tl.constexpr, DT: tl.constexpr = None):
    pass


@pytest.fixture
def launcher():
    """(thin kernel, launch log): compiles are stand-ins that log each launch with their own id."""
    import bench_triton_launch as bench

    log = []
    fn = triton_jit._jit(_kernel, False)
    with bench._Patched():
        fn.device_caches.clear()
        fn.device_caches[0]
        compiled = []

        def compile_(src, target=None, options=None, **_):
            k = bench._Compiled(sink=lambda *a, k=len(compiled): log.append((k, a)))
            compiled.append(k)
            return k
        fn.compile = compile_
        triton_launch.set_enabled(True)
        try:
            yield ThinKernel(fn), log
        finally:
            triton_launch.set_enabled(False)
            fn.device_caches.clear()


def _as_launched(a):
    return a.data_ptr() if isinstance(a, torch.Tensor) else a


def test_every_thin_launch_runs_the_kernel_triton_picks(launcher):
    thin, log = launcher
    base = torch.zeros(256, dtype=torch.bfloat16)
    other = torch.zeros(256, dtype=torch.float32)
    xs = [base[i:].as_subclass(OnGpu) for i in (0, 8, 16, 1, 24)] + [other[4:].as_subclass(OnGpu)]
    calls = []
    for x, y, n, stride, block, has_y, flag in itertools.product(xs[:3] + xs[3:], xs[:2], [1, 16, 100], [64, 7],
                                                                 [32, 64], [True, False], [True, False]):
        calls.append(((x, y, n, 0.5, flag, stride), dict(BLOCK=block, HAS_Y=has_y, num_warps=4)))
    calls.append(((xs[0], xs[1], 2**40, 0.5, True, 16), dict(BLOCK=32, HAS_Y=True, DT=tl.float32, num_warps=4)))
    calls.append(((xs[0], xs[1], 2**40, 0.5, True, 16), dict(BLOCK=32, HAS_Y=True, DT=tl.bfloat16, num_warps=4)))
    calls.append(((xs[0], xs[1], 2**40, 0.5, True, 16), dict(BLOCK=32, HAS_Y=True, DT=tl.bfloat16, num_warps=8)))
    for _ in range(2):  # the second round hits
        for args, kwargs in calls:
            thin[(3, 2)](*args, **kwargs)
            thin.fn.run(*args, grid=(3, 2), warmup=False, **kwargs)  # Triton's own pick for the same launch
            (k_thin, a_thin), (k_triton, a_triton) = log[-2:]
            assert k_thin == k_triton, (args, kwargs)
            # grid, stream, function, metadata; then (past the launch metadata and hooks) the arguments
            assert a_thin[:6] == a_triton[:6] and a_thin[:4] == (3, 2, 1, 0)
            assert [_as_launched(a) for a in a_thin[9:]] == [_as_launched(a) for a in a_triton[9:]], (args, kwargs)
    assert thin.hits >= len(calls) and thin.fallbacks == 0
    assert thin.misses == len(thin.entries) == len(thin.fn.device_caches[0][0])  # one entry per Triton kernel


def test_knobs_and_hooks_are_honoured(launcher):
    thin, log = launcher
    x = torch.zeros(64, dtype=torch.bfloat16).as_subclass(OnGpu)
    args, kwargs = (x, x, 3, 1.0, True, 16), dict(BLOCK=32, HAS_Y=False)
    thin[(1,)](*args, **kwargs)
    thin[(1,)](*args, **kwargs)
    assert (thin.misses, thin.hits) == (1, 1)
    knobs = triton.knobs
    with knobs.runtime.scope():
        knobs.runtime.debug = True  # Triton compiles another kernel for it: so must the thin key miss
        thin[(1,)](*args, **kwargs)
        assert thin.misses == 2 and log[-1][0] == 1
    thin[(1,)](*args, **kwargs)
    assert log[-1][0] == 0 and thin.hits == 2
    assert log[-1][1][6:9] == (None, None, None)  # a thin launch passes no metadata and no hooks
    hook = knobs.runtime.launch_enter_hook
    hook.add(print)
    try:
        thin[(1,)](*args, **kwargs)  # a hook wants the launch metadata: Triton's path (which passes the hook)
    finally:
        hook.remove(print)
    assert thin.fallbacks == 1 and log[-1][1][7] is hook


def test_what_the_key_does_not_model_takes_tritons_path(launcher):
    thin, log = launcher
    x = torch.zeros(64, dtype=torch.bfloat16).as_subclass(OnGpu)
    thin[(1,)](x, x, 3, 1.0, True, 16, 32, True)  # constexprs by position
    thin[(1,)](x, x, 3, 1.0, True, BLOCK=32, HAS_Y=True, stride=16)  # a runtime argument by keyword
    thin[lambda meta: (1,)](x, x, 3, 1.0, True, 16, BLOCK=32, HAS_Y=True)  # a callable grid
    assert thin.fallbacks == 3 and thin.hits == thin.misses == 0 and len(log) == 3
    triton_launch.set_enabled(False)
    thin[(1,)](x, x, 3, 1.0, True, 16, BLOCK=32, HAS_Y=True)
    assert thin.fallbacks == 4


def test_jitted_gives_the_interpreter_the_plain_function():
    from triton.runtime.interpreter import InterpretedFunction
    triton_launch.set_enabled(True)
    try:
        assert isinstance(triton_jit.jitted(_kernel, True), InterpretedFunction)
        thin = triton_jit.jitted(_kernel, False)
        assert isinstance(thin, ThinKernel) and thin.fn is triton_jit._jit(_kernel, False)
    finally:
        triton_launch.set_enabled(False)
    assert triton_jit.jitted(_kernel, False) is thin.fn


if __name__ == "__main__":  # run by test_key_against_the_gpu_image_triton with that triton first on the path
    print(f"triton {triton.__version__}: {check_against_triton()} pairs agree")

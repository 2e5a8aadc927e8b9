"""Host cost of one Triton kernel launch on the eager path, measured on the CPU (no GPU needed).

    python tools/profile/bench_triton_launch.py [--repeats 7] [--calls 2000] [--forward]

Each of the forward's kernel wrappers (add_rms_norm, rotary_kv, paged attention, gate_up_silu,
silu_mul) runs in compiled mode on CPU tensors of SmolLM2-135M's sizes against a stand-in driver:
Triton's real `JITFunction.run` (binder, key, cache lookup, launch metadata, its CudaLauncher-like
Python call) or the thin launcher (slipstream/models/kernels/triton_launch.py), but the compiled
kernel's C launcher is a no-op. So a row is the Python a launch costs, without the C launcher's own
work (argument parsing, the per-pointer driver query the thin path skips, cuLaunchKernelEx).
Columns: the wrapper with a no-op kernel (validation, allocation), with Triton's launch, with the
thin launch; CPU µs per call (process time over --calls calls) as median / mean / p90 of
--repeats interleaved runs; and Python-level calls per launch (sys.setprofile, deterministic).
`tensor.is_cuda` is faked True (the thin key refuses host tensors), which adds a Python property
call per tensor to the thin column only.

--forward adds one table for the whole eager forward (forward_triton) of random-smollm2-135m, one
decode token at context 128, on the `meta` device: torch's ops dispatch but compute nothing and
allocate nothing, so a row is the forward's Python and dispatch cost with no-op kernels, Triton's
launches or thin ones (a lower bound for the CUDA host path: no caching allocator, no cuBLAS, no C
launcher).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers

import torch  # noqa: E402

from slipstream.models.kernels import (add_norm_triton, attention_triton, gate_up_silu_triton,  # noqa: E402
                                       rotary_kv_triton, silu_mul_triton, triton_jit, triton_launch)

MODULES = (add_norm_triton, attention_triton, gate_up_silu_triton, rotary_kv_triton, silu_mul_triton)


def _noop(*args, **kwargs):
    return None


class _Launcher:
    """Stands in for the compiled kernel's CudaLauncher: its Python part, then `sink` for the C call."""
    global_scratch_size = profile_scratch_size = 0

    def __init__(self, sink=_noop):
        self.sink = sink

    def __call__(self, gx, gy, gz, stream, function, *args):
        def allocate_scratch(size):
            return None if size <= 0 else size
        allocate_scratch(self.global_scratch_size)
        allocate_scratch(self.profile_scratch_size)
        self.sink(gx, gy, gz, stream, function, *args)


class _Compiled:
    def __init__(self, sink=_noop):
        self.run, self.function, self.packed_metadata = _Launcher(sink), 0, (4, 1, 0)

    def launch_metadata(self, grid, stream, *args):  # CompiledKernel's: hooks are a HookChain since 3.5
        from triton import knobs
        from triton.compiler.compiler import LazyDict
        return None if knobs.runtime.launch_enter_hook is None else LazyDict({"name": "k", "stream": stream})


class _Driver:
    def __init__(self):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 0

    def get_current_target(self):
        return self.target


def _fake_compile(src, target=None, options=None, **_):
    return _Compiled()


class _Patched:
    """Compiled mode on CPU tensors: the stand-in driver, no-op compiles, `is_cuda` faked True."""

    def __enter__(self):
        import triton
        self.triton, self.saved = triton, {m: m.interpreted for m in MODULES}
        self.active = triton.runtime.driver._active
        for m in MODULES:
            m.interpreted = lambda t: False
        triton.runtime.driver.set_active(_Driver())
        torch.Tensor.is_cuda = property(lambda self: True)
        return self

    def __exit__(self, *exc):
        for m, f in self.saved.items():
            m.interpreted = f
        del torch.Tensor.is_cuda
        self.triton.runtime.driver._active = self.active


def _prepare(fn) -> None:
    k = triton_jit._jit(fn, False)
    k.device_caches[0]  # builds the binder (and sets k.compile), then compiles go to the stand-in
    k.compile = _fake_compile


class _NoKernel:
    def __getitem__(self, grid):
        return _noop


def cases():
    """(name, kernel fn, call) per wrapper, SmolLM2-135M sizes, one decode token at context 128."""
    bf = torch.bfloat16
    hidden, heads, kvh, d, inter, ps = 576, 9, 3, 64, 1536, 16
    x, res, w = torch.randn(1, hidden, dtype=bf), torch.randn(1, hidden, dtype=bf), torch.randn(hidden, dtype=bf)
    qkv = torch.randn(1, (heads + 2 * kvh) * d, dtype=bf)
    q, k, v = (qkv[:, :heads * d].view(1, heads, d), qkv[:, heads * d:(heads + kvh) * d].view(1, kvh, d),
               qkv[:, (heads + kvh) * d:].view(1, kvh, d))
    kc, vc = torch.randn(64 * ps, kvh, d, dtype=bf), torch.randn(64 * ps, kvh, d, dtype=bf)
    cos, sin = torch.randn(2048, d), torch.randn(2048, d)
    pos, idx = torch.tensor([128]), torch.tensor([200])
    qs, lens, pages = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([129], dtype=torch.int32), \
        torch.arange(9, dtype=torch.int32)[None]
    out = torch.empty(1, heads, d, dtype=bf)
    gu, g = torch.randn(2 * inter, hidden, dtype=bf), torch.randn(1, inter, dtype=bf)
    return [
        ("add_rms_norm", add_norm_triton._add_rms_norm_kernel,
         lambda: add_norm_triton.add_rms_norm_triton(x, res, w, 1e-5)),
        ("rotary_kv", rotary_kv_triton._rotary_kv_kernel,
         lambda: rotary_kv_triton.rotary_kv_triton(q, k, v, pos, cos, sin, kc, vc, idx)),
        ("paged_attention", attention_triton.paged_attention_kernel,
         lambda: attention_triton.paged_attention_triton(q, kc, vc, qs, lens, pages, ps, 1, out)),
        ("gate_up_silu", gate_up_silu_triton._gate_up_silu_kernel,
         lambda: gate_up_silu_triton.gate_up_silu_triton(x, gu)),
        ("silu_mul", silu_mul_triton._silu_mul_kernel, lambda: silu_mul_triton.silu_mul_triton(g, g)),
    ]


def cpu_us(call, n: int) -> float:
    t0 = time.process_time_ns()
    for _ in range(n):
        call()
    return (time.process_time_ns() - t0) / n / 1e3


def python_calls(call) -> int:
    count = 0

    def prof(frame, event, arg):
        nonlocal count
        count += event in ("call", "c_call")
    sys.setprofile(prof)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count


def stats(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs):.2f} / {statistics.mean(xs):.2f} / {xs[round(0.9 * (len(xs) - 1))]:.2f}"


def meta_forward():
    """(call running one eager decode forward of random-smollm2-135m on the meta device, its kernels)."""
    from host_batch import Chunk, host_batch

    from slipstream.models.base import KVCache
    from slipstream.models.kernels.attention import DeviceAttentionMetadata
    from slipstream.models.loading.build import build_model

    meta = torch.device("meta")
    model, _, cfg = build_model("random-smollm2-135m", "bfloat16", meta)
    model.set_kernel_backend("triton")
    kv = KVCache(cfg, num_pages=64, page_size=16, dtype=torch.bfloat16, device=meta)
    batch, _ = host_batch([Chunk([5], 128, list(range(1, 10)))], 16, device=meta)
    m = batch.attn
    m.on_device = DeviceAttentionMetadata(torch.tensor(m.query_start, device=meta), torch.tensor(m.kv_lens, device=meta),
                                          torch.tensor(m.page_tables, device=meta), 1)
    return lambda: model(batch, kv)


def variant(name: str):
    """Sets the launch path: 'none' (a no-op kernel), 'triton', 'thin', or 'main': Triton's launcher
    with triton.cdiv / triton.next_power_of_2 in the wrappers, as before the host helpers."""
    import triton
    for m in MODULES:
        m.jitted = (lambda fn, interpret: _NoKernel()) if name == "none" else triton_jit.jitted
        for helper in ("cdiv", "next_power_of_2"):
            if hasattr(m, helper):
                setattr(m, helper, getattr(triton if name == "main" else triton_jit, helper))
    triton_launch.set_enabled(name == "thin")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--forward", action="store_true", help="also the whole eager forward on the meta device")
    ap.add_argument("--profile", action="store_true", help="with --forward: cProfile of 20 thin forwards")
    args = ap.parse_args(argv)
    from slipstream.provenance import header, provenance

    print(header(provenance()), flush=True)
    import triton
    print(f"triton {triton.__version__}, torch {torch.__version__}; compiled mode against a stand-in driver "
          f"(no C launcher); {args.repeats} interleaved repeats of {args.calls} calls\n")
    print("| kernel wrapper | main: + Triton launch, triton's helpers µs | wrapper alone µs | + Triton launch µs "
          "| + thin launch µs | Triton launch alone µs "
          "| thin launch alone µs | Python calls: wrapper / Triton / thin |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    names = ("main", "none", "triton", "thin")
    saved = {m: m.jitted for m in MODULES}
    try:
        with _Patched():
            for name, fn, call in cases():
                _prepare(fn)
                times: dict[str, list[float]] = {v: [] for v in names}
                calls = {}
                for v in names:  # warm: the first thin launch of a key goes through Triton
                    variant(v)
                    for _ in range(3):
                        call()
                    calls[v] = python_calls(call)
                for _ in range(args.repeats):
                    for v in names:
                        variant(v)
                        times[v].append(cpu_us(call, args.calls))
                alone = {v: [t - n for t, n in zip(times[v], times["none"])] for v in ("triton", "thin")}
                print(f"| {name} | {stats(times['main'])} | {stats(times['none'])} | {stats(times['triton'])} "
                      f"| {stats(times['thin'])} | {stats(alone['triton'])} | {stats(alone['thin'])} "
                      f"| {calls['none']} / {calls['triton']} / {calls['thin']} |", flush=True)
            print("\nmedian / mean / p90 of CPU µs per call; 'alone' = the column minus the no-op-kernel wrapper, "
                  "per repeat")
            if args.forward:
                forward_table(args, names)
    finally:
        variant("triton")  # the wrappers' own host helpers back
        for m, f in saved.items():
            m.jitted = f
        triton_launch.set_enabled(False)
    return 0


def forward_table(args, names) -> None:
    call = meta_forward()
    times: dict[str, list[float]] = {v: [] for v in names}
    calls = {}
    for v in names:
        variant(v)
        for _ in range(3):
            call()
        calls[v] = python_calls(call)
    n = max(1, args.calls // 100)
    for _ in range(args.repeats):
        for v in names:
            variant(v)
            times[v].append(cpu_us(call, n))
    print(f"\nwhole eager forward, random-smollm2-135m (30 layers, bf16), 1 decode token, meta device; "
          f"{args.repeats} interleaved repeats of {n} forwards\n")
    print("| kernels launched by | CPU µs per forward | Python calls per forward |\n|---|---:|---:|")
    for v, label in zip(names, ("main: Triton's launcher, triton.cdiv/next_power_of_2 in the wrappers",
                                "no-op kernels (wrappers and torch ops only)", "Triton's launcher", "thin launcher")):
        print(f"| {label} | {stats(times[v])} | {calls[v]} |", flush=True)
    if args.profile:
        import cProfile
        import io
        import pstats
        variant("thin")
        prof = cProfile.Profile()
        prof.runcall(lambda: [call() for _ in range(20)])
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print("\ncProfile of 20 thin forwards (ncalls / 20 = per forward), by own time:\n\n```")
        print(out.getvalue().strip())
        print("```")


if __name__ == "__main__":
    sys.exit(main())

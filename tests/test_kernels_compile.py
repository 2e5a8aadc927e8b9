"""Every Triton kernel of the GPU path compiles for sm_90 (H100/H200) on this CPU machine, with the
GPU image's triton, at the shapes of SmolLM2, Llama-3 and Qwen2 (and head dim 256), in bf16, fp16
and fp32, with the argument types the runtime passes (tests/test_kernel_runtime_dtypes.py).

The CPU tests run kernels in Triton's interpreter, which skips the compiler's type checks: a kernel
can pass them all and still not compile for a GPU (a loop-carried variable changing type did, in the
mixed-graph attention grid). Triton's wheel bundles ptxas, so the whole Triton → PTX → cubin path
runs here (tools/gpu/kernel_resources.py has the cases).

Two compilers: the triton installed here (newer; its interpreter runs the other CPU tests, and
triton 3.6.0's interpreter fails on numpy >= 2.4) compiles SmolLM2's bf16 cases in this process
(a newer triton still compiles them); the GPU image's triton (GPU_IMAGE_TRITON, installed on first use into a cache folder, without dependencies)
compiles every case in a subprocess.

Both compile the cover of the cases (kernel_resources.cover_cases: each kernel x dtype x branch once,
at its largest tiles), a quarter of the whole set; SLIPSTREAM_KERNELS_ALL=1 compiles every case
(~6 minutes on two cores), as `python tools/gpu/kernel_resources.py --model all --dtype bfloat16 float16
float32` does: run it after changing a kernel's tiling or launch configuration."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "gpu"))

import kernel_resources  # noqa: E402

GPU_IMAGE_TRITON = "3.6.0"  # the GPU machines' image (docs/cuda.md): what compiles the kernels there
DTYPES = ["bfloat16", "float16", "float32"]
ALL = os.environ.get("SLIPSTREAM_KERNELS_ALL") == "1"
SELECT = kernel_resources.unique_cases if ALL else kernel_resources.cover_cases
LOCAL = SELECT(list(kernel_resources.SHAPES), [torch.bfloat16])  # the GPU's default dtype


@pytest.mark.parametrize("name,dtype,case", LOCAL,
                         ids=[f"{c[0].__name__}-{str(d)[6:]}-{i}" for i, (_, d, c) in enumerate(LOCAL)])
def test_kernel_compiles_for_sm90(name, dtype, case):
    fn, signature, constexprs, options = case
    compiled = kernel_resources.compile_kernel(fn, signature, constexprs, 90, **options)
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= kernel_resources.SHARED_LIMIT


def gpu_image_triton() -> Path | None:
    """A folder holding triton==GPU_IMAGE_TRITON (SLIPSTREAM_GPU_TRITON_DIR, or a cache folder
    filled with pip on first use); None when the installed triton is that version."""
    if triton.__version__ == GPU_IMAGE_TRITON:
        return None
    given = os.environ.get("SLIPSTREAM_GPU_TRITON_DIR")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slipstream"
    folder = Path(given) if given else cache / f"triton-{GPU_IMAGE_TRITON}"
    if not (folder / "triton" / "__init__.py").exists():
        if given:
            pytest.fail(f"SLIPSTREAM_GPU_TRITON_DIR={given} holds no triton")
        partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                              str(partial), f"triton=={GPU_IMAGE_TRITON}"], capture_output=True, text=True)
        if pip.returncode:
            pytest.fail(f"could not install triton=={GPU_IMAGE_TRITON} into {partial} (set SLIPSTREAM_GPU_TRITON_DIR "
                        f"to a folder made with `pip install --target DIR --no-deps triton=={GPU_IMAGE_TRITON}`):\n"
                        f"{pip.stderr[-2000:]}")
        partial.rename(folder)  # whole or not at all
    return folder


def test_every_case_compiles_with_the_gpu_image_triton():
    folder = gpu_image_triton()
    everything = SELECT(list(kernel_resources.SHAPES), [kernel_resources.DTYPES[d] for d in DTYPES])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(p) for p in (folder, ROOT) if p is not None]))
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu" / "kernel_resources.py"), "--model", "all",
                          "--dtype", *DTYPES, "--no-usage", *([] if ALL else ["--cover"])], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert f"{len(everything)} of {len(everything)} compiled for sm_90 with triton {GPU_IMAGE_TRITON}" in run.stdout
    for shape in {name for name, _, _ in everything}:  # each shape's cases are in the table
        assert f"| {shape} |" in run.stdout
    assert torch.float16 in {d for _, d, _ in everything}


def test_the_cover_has_every_kernel_dtype_and_branch_at_its_largest_tiles():
    dtypes = [kernel_resources.DTYPES[d] for d in DTYPES]
    every = kernel_resources.unique_cases(list(kernel_resources.SHAPES), dtypes)
    cover = kernel_resources.cover_cases(list(kernel_resources.SHAPES), dtypes)
    def key(c):
        return c[2][0], c[1], kernel_resources.switches(c[2])
    assert {key(c) for c in cover} == {key(c) for c in every} and len(cover) == len({key(c) for c in every})
    for c in every:  # none of the whole set has bigger tiles than its combination's case in the cover
        chosen = next(x for x in cover if key(x) == key(c))
        assert kernel_resources.tile(c[2]) <= kernel_resources.tile(chosen[2])
    assert len(cover) < len(every) / 2  # the point of it

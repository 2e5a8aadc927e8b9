"""Every Triton kernel of the GPU path compiles for sm_90 (H100/H200) on this CPU machine.

The CPU tests run kernels in Triton's interpreter, which skips the compiler's type checks: a kernel
can pass them all and still not compile for a GPU (a loop-carried variable changing type did, in the
mixed-graph attention grid). Triton's wheel bundles ptxas, so the whole Triton → PTX → cubin path
runs here (tools/kernel_resources.py has the cases, with the model's shapes)."""
import os
import sys

import pytest
import torch

triton = pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import kernel_resources  # noqa: E402
from slipstream.models.build import RANDOM  # noqa: E402

CASES = [(dtype, case) for dtype in (torch.bfloat16, torch.float32)
         for case in kernel_resources.cases(RANDOM["random-smollm2-135m"](), dtype)]


@pytest.mark.parametrize("dtype,case", CASES, ids=[f"{c[0].__name__}-{str(d)[6:]}-{i}" for i, (d, c) in enumerate(CASES)])
def test_kernel_compiles_for_sm90(dtype, case):
    fn, signature, constexprs, options = case
    compiled = kernel_resources.compile_kernel(fn, signature, constexprs, 90, **options)
    assert compiled.asm["cubin"]
    assert compiled.metadata.shared <= 227 * 1024  # what an H100 block may use

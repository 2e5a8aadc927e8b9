"""What the runtime passes to each Triton kernel is what tools/gpu/kernel_resources.py declares, and so
what tests/test_kernels_compile.py compiles for sm_90: argument types recorded at the real call
sites, in an engine on the triton backend (kernels interpreted on the CPU), for bf16 and fp16 models.

The rotary cos/sin tables are buffers of the model, so `model.to(dtype)` casts them: a bf16 model
passes bf16 tables. That is right: the kernel rounds the tables to the activation dtype anyway (as
the reference path and Hugging Face do), so a bf16 table holds the same values in half the bytes."""
import asyncio
import inspect
import os
import sys

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gpu"))

import kernel_resources  # noqa: E402

from slipstream import Engine, EngineConfig, SamplingParams  # noqa: E402
from slipstream.models.kernels import (add_norm_triton, attention_triton, decode_fused_triton,  # noqa: E402
                                       gate_up_silu_triton, gemv_splitk_triton, rotary_kv_triton, silu_mul_triton)
from slipstream.models.kernels.gemm_choice import Gemv  # noqa: E402
from slipstream.models.config import tiny_config  # noqa: E402
from slipstream.models.kernels.rotary import RotaryEmbedding  # noqa: E402
from slipstream.models.llama.forward_triton import TritonOptions  # noqa: E402

MODULES = (add_norm_triton, attention_triton, decode_fused_triton, gate_up_silu_triton, gemv_splitk_triton,
           rotary_kv_triton, silu_mul_triton)
LAUNCH_OPTIONS = {"num_warps", "num_stages"}
POINTEE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
           torch.int32: "i32", torch.bool: "i1"}


def triton_type(x) -> str:
    """The signature type Triton's launcher gives a Python argument."""
    if isinstance(x, torch.Tensor):
        return "*" + POINTEE[x.dtype]
    if isinstance(x, bool):
        return "i1"
    if isinstance(x, int):
        return "i32" if -2**31 <= x < 2**31 else "i64"
    if isinstance(x, float):
        return "fp32"
    return type(x).__name__


def recording(monkeypatch) -> dict[str, list[tuple[dict, dict]]]:
    """Wraps each kernel module's `jitted`: every launch records ({argument: type}, {switch: value})
    by kernel name; switches are the boolean constexprs (HAS_ROWS, FLAT...)."""
    seen: dict[str, list[tuple[dict, dict]]] = {}
    for module in MODULES:
        def jitted(fn, interpret, real=module.jitted):
            kernel, names = real(fn, interpret), list(inspect.signature(fn).parameters)

            class Launcher:
                def __getitem__(self, grid):
                    def launch(*args, **kwargs):
                        bound = {**dict(zip(names, args)), **kwargs}
                        seen.setdefault(fn.__name__, []).append(
                            ({k: triton_type(v) for k, v in bound.items() if k not in LAUNCH_OPTIONS},
                             {k: v for k, v in bound.items() if isinstance(v, bool)}))
                        return kernel[grid](*args, **kwargs)
                    return launch
            return Launcher()
        monkeypatch.setattr(module, "jitted", jitted)
    return seen


def declared(dtype) -> dict[str, list[tuple[dict, dict]]]:
    """kernel name -> the (signature, constexprs) of each case kernel_resources compiles."""
    out = {}
    for fn, sig, consts, _ in kernel_resources.cases(tiny_config(), dtype):
        out.setdefault(fn.__name__, []).append((sig, consts))
    return out


def matching_case(types: dict, switches: dict, cases: list) -> dict | None:
    """The case with the launch's switches (they decide what a placeholder argument is, e.g. the
    norm's ROWS without rows), if its signature is the launch's argument types; else None."""
    for sig, consts in cases:
        if {k: v for k, v in consts.items() if isinstance(v, bool)} == switches:
            return sig if {k: v for k, v in types.items() if k not in consts} == sig else None
    return None


@pytest.mark.filterwarnings(r"ignore:(overflow|invalid value) encountered:RuntimeWarning")  # padding rows
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_runtime_kernel_arguments_are_the_compiled_signature(monkeypatch, dtype):
    seen = recording(monkeypatch)
    # decode splits its keys (and runs the merge kernel) at this test's one-page contexts, as a long
    # context would: splits of >= 4 keys
    monkeypatch.setattr(attention_triton, "MIN_SPLIT", 4)
    torch_dtype = kernel_resources.DTYPES[dtype]

    async def run():
        cfg = EngineConfig(model="tiny-random", dtype=dtype, max_batch_size=4, max_num_batched_tokens=48,
                           kv_cache_tokens=512, page_size=8, batch_invariant=False)
        async with Engine(cfg) as engine:
            model = engine._parts.runner.model
            # prefill steps (> 4 rows) take cuBLAS + the SiLU·up kernel, decode steps of both sequences
            # the gate-up GEMM, and those of the longer one alone the fused decode layer
            model.set_kernel_backend("triton", TritonOptions(mlp_gemm_max_rows=4, fused_decode_max_rows=1,
                                                             small_gemm_max_rows=2))
            # the decode steps of both sequences (2 rows): QKV on the unsplit GEMV, o_proj and down split
            # (partials and the reduction); the CPU measures nothing, so the choice is set here
            from slipstream.models.llama.forward_triton import small_gemm_weights

            model.small_gemms = {(2, w.shape[0], w.shape[1]): Gemv(8, 1 if i == 0 else 2)
                                 for i, w in enumerate(small_gemm_weights(model)[:3])}
            assert model.rope.cos.dtype == model.rope.sin.dtype == torch_dtype  # cast with the model
            await asyncio.gather(*(engine.complete([5 + i, 6, 7, 8, 9, 10], SamplingParams(
                max_tokens=3 + 4 * i, temperature=0.0, ignore_eos=True)) for i in range(2)))

    asyncio.run(run())
    want = declared(torch_dtype)
    assert set(seen) == set(want)  # every kernel of the forward ran
    for name, launches in seen.items():
        for types, switches in launches:
            assert matching_case(types, switches, want[name]) is not None, (
                f"{name} {switches}: the runtime passes {types}, kernel_resources compiles {want[name]}")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_rotary_kv_with_tables_in_the_model_dtype_matches_reference(device, dtype):
    """The tables as the runtime holds them (cast with the model), not fp32 as built."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    cfg = tiny_config()
    rope = RotaryEmbedding(cfg).to(device=device, dtype=dtype)
    assert rope.cos.dtype == dtype
    tokens, heads, kv_heads, d, slots = 5, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(tokens, h, d, generator=g).to(device=device, dtype=dtype) for h in (heads, kv_heads, kv_heads))
    positions = torch.tensor([0, 7, 100, 1023, 4095], device=device)
    kv_indices = torch.tensor([3, 0, 15, 8, 9], device=device)
    caches = [torch.zeros(slots, kv_heads, d, dtype=dtype, device=device) for _ in range(4)]
    want_q = q.clone()
    rotary_kv_triton.rotary_kv_reference(want_q, k, v, positions, rope.cos, rope.sin, caches[0], caches[1],
                                         kv_indices)
    rotary_kv_triton.rotary_kv_triton(q, k, v, positions, rope.cos, rope.sin, caches[2], caches[3], kv_indices)
    # one rounding of the output where the reference rounds the two products too
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(q.float(), want_q.float(), **tol)
    torch.testing.assert_close(caches[2].float(), caches[0].float(), **tol)
    assert caches[3].equal(caches[1])

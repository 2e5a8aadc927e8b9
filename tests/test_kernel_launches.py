"""Kernel launches per decode step of the triton backend, counted on the CPU: a regression in the
fusion (an extra add, a zero-fill, an unfused matmul) fails here without a GPU."""
import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from triton_model_util import NO_MLP_GEMM, UNFUSED, build, with_device_metadata  # noqa: E402

from slipstream.models.config import tiny_config  # noqa: E402
from host_batch import Chunk, host_batch  # noqa: E402
from launch_counter import count_launches  # noqa: E402
from slipstream.models.base import KVCache  # noqa: E402


def decode_launches(num_layers: int, options=None) -> list[str]:
    """Launches of one decode step (three sequences, one token each) on the triton backend."""
    cfg = dataclasses.replace(tiny_config(), num_layers=num_layers)
    model = build(cfg, torch.bfloat16, "triton", options)  # bf16, as served on the GPU
    kv = KVCache(cfg, num_pages=8, page_size=4, dtype=torch.bfloat16, device="cpu")
    batch, _ = host_batch([Chunk([5], 0, [1]), Chunk([6], 0, [2]), Chunk([7], 0, [3])], 4)
    batch = with_device_metadata(batch)
    with count_launches() as counter:
        model(batch, kv)
    return counter.launches


# One decode layer on the triton backend: 8 launches, from 18 before fusion (docs/cuda.md); a decode
# that splits its keys (few sequences, a wide page table: not these) adds the merge: 9.
LAYER = ["_add_rms_norm_kernel", "mm", "_rotary_kv_kernel", "_grouped_attention_kernel", "mm",
         "_add_rms_norm_kernel", "_gate_up_silu_kernel", "mm"]
# Per step besides the layers: embedding lookup, final norm (sampled rows only), lm_head, and the
# float32 cast of the logits.
OUTSIDE_LAYERS = ["embedding", "_add_rms_norm_kernel", "mm", "_to_copy"]


def test_decode_step_launches_eight_kernels_per_layer():
    two, three = decode_launches(2), decode_launches(3)
    assert three[1:1 + len(LAYER)] == LAYER  # after the embedding lookup, the first layer in order
    assert len(three) - len(two) == len(LAYER)  # what one more layer costs
    assert sorted(two) == sorted(OUTSIDE_LAYERS + 2 * LAYER)
    # SmolLM2-135M (30 layers): 8 * 30 + 4 = 244 kernels a step from the model (548 before, with
    # the runner's own few); the bound is 250
    assert len(LAYER) * 30 + len(OUTSIDE_LAYERS) == 244


def test_launches_without_the_mlp_gemm_or_fused_projections():
    """Above mlp_gemm_max_rows (prefill) the MLP is cuBLAS + SiLU·up: 9 a layer; unfused
    projections add two matmuls for q/k/v and one for gate/up: 12."""
    no_gemm = decode_launches(1, NO_MLP_GEMM)
    assert no_gemm.count("_silu_mul_kernel") == 1 and no_gemm.count("mm") == 5
    unfused = decode_launches(1, UNFUSED)
    assert len(unfused) - len(no_gemm) == 3 and unfused.count("mm") == 8


def test_options_are_validated():
    from slipstream.models.llama.forward_triton import TritonOptions

    with pytest.raises(ValueError, match="mlp_gemm_max_rows"):
        TritonOptions(mlp_gemm_max_rows=-1)
    model = build(tiny_config(), torch.float32, "reference")
    with pytest.raises(TypeError, match="TritonOptions"):
        model.set_kernel_backend("triton", {"fuse_projections": False})


@pytest.mark.cuda
def test_gpu_profiler_sees_the_same_launches_per_layer():
    """The CPU count against torch.profiler's CUDA kernels: one more layer costs len(LAYER)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from torch.profiler import ProfilerActivity, profile

    def gpu_kernels(num_layers: int) -> list[str]:
        cfg = dataclasses.replace(tiny_config(), num_layers=num_layers)
        model = build(cfg, torch.bfloat16, "triton", device="cuda")
        kv = KVCache(cfg, num_pages=8, page_size=4, dtype=torch.bfloat16, device="cuda")
        batch, _ = host_batch([Chunk([5], 0, [1]), Chunk([6], 0, [2]), Chunk([7], 0, [3])], 4, device="cuda")
        batch = with_device_metadata(batch)
        model(batch, kv)  # compile outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(batch, kv)
            torch.cuda.synchronize()
        return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    two, three = gpu_kernels(2), gpu_kernels(3)
    assert len(three) - len(two) == len(LAYER), (two, three)

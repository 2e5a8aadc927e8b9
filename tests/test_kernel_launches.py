"""Kernel launches per decode step of the triton backend, counted on the CPU: a regression in the
fusion (an extra add, a zero-fill, an unfused matmul) fails here without a GPU."""
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from triton_model_util import NO_MLP_GEMM, UNFUSED, build, with_device_metadata  # noqa: E402

from slipstream.models.config import tiny_config  # noqa: E402
from slipstream.models.host_batch import Chunk, host_batch  # noqa: E402
from slipstream.models.llama import KVCache  # noqa: E402


class LaunchCounter(TorchDispatchMode):
    """Records what would be a GPU kernel launch: every torch op that computes (views and empty
    allocations launch nothing) and every Triton kernel launch (whose own internal torch ops, in
    the interpreter, are not counted)."""

    NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "lift_fresh"}

    def __init__(self):
        super().__init__()
        self.launches: list[str] = []
        self.inside_triton = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_triton and not func.is_view and name not in self.NO_KERNEL:
            self.launches.append(name)
        return func(*args, **(kwargs or {}))

    def wrap(self, jitted):
        counter = self

        def counting(fn, interpret):
            kernel = jitted(fn, interpret)

            class Launch:
                def __getitem__(self, grid):
                    def run(*args, **kwargs):
                        counter.launches.append(fn.__name__)
                        counter.inside_triton += 1
                        try:
                            return kernel[grid](*args, **kwargs)
                        finally:
                            counter.inside_triton -= 1
                    return run
            return Launch()
        return counting


def decode_launches(num_layers: int, monkeypatch, options=None) -> list[str]:
    """Launches of one decode step (three sequences, one token each) on the triton backend."""
    from slipstream.models import add_norm_triton, attention_triton, gate_up_silu_triton, norm_rope_triton, \
        rotary_kv_triton, silu_mul_triton, triton_jit

    cfg = dataclasses.replace(tiny_config(), num_layers=num_layers)
    model = build(cfg, torch.bfloat16, "triton", options)  # bf16, as served on the GPU
    kv = KVCache(cfg, num_pages=8, page_size=4, dtype=torch.bfloat16, device="cpu")
    batch, _ = host_batch([Chunk([5], 0, [1]), Chunk([6], 0, [2]), Chunk([7], 0, [3])], 4)
    batch = with_device_metadata(batch)
    counter = LaunchCounter()
    for module in (add_norm_triton, attention_triton, gate_up_silu_triton, norm_rope_triton, rotary_kv_triton,
                   silu_mul_triton):
        monkeypatch.setattr(module, "jitted", counter.wrap(triton_jit.jitted))
    with counter:
        model(batch, kv)
    return counter.launches


# One decode layer on the triton backend: 8 launches, from 18 before fusion (docs/cuda.md).
LAYER = ["_add_rms_norm_kernel", "mm", "_rotary_kv_kernel", "_paged_attention_kernel", "mm",
         "_add_rms_norm_kernel", "_gate_up_silu_kernel", "mm"]
# Per step besides the layers: embedding lookup, final norm (sampled rows only), lm_head, and the
# float32 cast of the logits.
OUTSIDE_LAYERS = ["embedding", "_add_rms_norm_kernel", "mm", "_to_copy"]


def test_decode_step_launches_eight_kernels_per_layer(monkeypatch):
    two, three = decode_launches(2, monkeypatch), decode_launches(3, monkeypatch)
    assert three[1:1 + len(LAYER)] == LAYER  # after the embedding lookup, the first layer in order
    assert len(three) - len(two) == len(LAYER)  # what one more layer costs
    assert sorted(two) == sorted(OUTSIDE_LAYERS + 2 * LAYER)
    # SmolLM2-135M (30 layers): 8 * 30 + 4 = 244 kernels a step from the model (548 before, with
    # the runner's own few); the bound is 250
    assert len(LAYER) * 30 + len(OUTSIDE_LAYERS) == 244


def test_launches_without_the_mlp_gemm_or_fused_projections(monkeypatch):
    """Above mlp_gemm_max_rows (prefill) the MLP is cuBLAS + SiLU·up: 9 a layer; unfused
    projections add two matmuls for q/k/v and one for gate/up: 12."""
    no_gemm = decode_launches(1, monkeypatch, NO_MLP_GEMM)
    assert no_gemm.count("_silu_mul_kernel") == 1 and no_gemm.count("mm") == 5
    unfused = decode_launches(1, monkeypatch, UNFUSED)
    assert len(unfused) - len(no_gemm) == 3 and unfused.count("mm") == 8

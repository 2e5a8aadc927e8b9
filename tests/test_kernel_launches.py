"""Kernel launches per decode step of the triton backend, counted on the CPU: a regression in the
fusion (an extra add, a zero-fill, an unfused matmul) fails here without a GPU."""
import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from triton_model_util import FUSED_DECODE, LAYERWISE, NO_MLP_GEMM, UNFUSED, build, with_device_metadata  # noqa: E402

from slipstream.models.config import tiny_config  # noqa: E402
from host_batch import Chunk, host_batch  # noqa: E402
from launch_counter import count_launches  # noqa: E402
from slipstream.models.base import KVCache  # noqa: E402


ROWS = 3  # decode_launches' step: three sequences, one token each


def decode_model(num_layers: int, options=None, prepare=None):
    cfg = dataclasses.replace(tiny_config(), num_layers=num_layers)
    model = build(cfg, torch.bfloat16, "triton", options)  # bf16, as served on the GPU
    if prepare is not None:
        prepare(model)
    return model


def decode_launches(num_layers: int, options=None, prepare=None, model=None) -> list[str]:
    """Launches of one decode step (three sequences, one token each) on the triton backend."""
    model = model or decode_model(num_layers, options, prepare)
    cfg = model.config
    kv = KVCache(cfg, num_pages=8, page_size=4, dtype=torch.bfloat16, device="cpu")
    batch, _ = host_batch([Chunk([5], 0, [1]), Chunk([6], 0, [2]), Chunk([7], 0, [3])], 4)
    batch = with_device_metadata(batch)
    with count_launches() as counter:
        model(batch, kv)
    return counter.launches


# One decode layer on the triton backend: 5 launches (the fused decode layer, decode_fused_triton.py):
# norm + QKV + rotary + KV write, attention, o_proj + residual, norm + gate-up + SiLU·up, down + residual.
# A decode that splits its keys (few sequences, a wide page table: not these) adds the merge.
LAYER = ["_norm_qkv_rotary_kernel", "_grouped_attention_kernel", "_decode_linear_kernel", "_decode_linear_kernel",
         "_decode_linear_kernel"]
# Above fused_decode_max_rows: 8, from 18 before fusion (docs/cuda.md).
LAYERWISE_LAYER = ["_add_rms_norm_kernel", "mm", "_rotary_kv_kernel", "_grouped_attention_kernel", "mm",
                   "_add_rms_norm_kernel", "_gate_up_silu_kernel", "mm"]
# Per step besides the layers: embedding lookup, final norm (sampled rows only), lm_head, and the
# float32 cast of the logits.
OUTSIDE_LAYERS = ["embedding", "_add_rms_norm_kernel", "mm", "_to_copy"]


def expected_layer(model, rows: int) -> list[str]:
    """One layer's launches for a step of `rows` rows: the layer forward_triton picks under the
    model's options (built without options, as the engine builds it: TRITON_DEFAULTS), not a
    constant, so a change of default moves the expectation with it."""
    from slipstream.models.llama.forward_triton import takes_fused_decode

    return LAYER if takes_fused_decode(model, rows) else LAYERWISE_LAYER


@pytest.mark.parametrize("options,layer", [(FUSED_DECODE, LAYER), (None, None), (LAYERWISE, LAYERWISE_LAYER)],
                         ids=["fused_decode", "default", "layerwise"])
def test_decode_step_launches_per_layer(options, layer):
    layer = layer or expected_layer(decode_model(1, options), ROWS)  # None: whatever the default picks
    two, three = decode_launches(2, options), decode_launches(3, options)
    assert three[1:1 + len(layer)] == layer  # after the embedding lookup, the first layer in order
    assert len(three) - len(two) == len(layer)  # what one more layer costs
    assert sorted(two) == sorted(OUTSIDE_LAYERS + 2 * layer)


def test_smollm2_step_launch_counts():
    # SmolLM2-135M (30 layers): 5 * 30 + 4 = 154 kernels a step from the model at decode (8 * 30 +
    # 4 = 244 before the fused decode layer, 548 before any fusion); issue 42's bound is 100
    assert len(LAYER) * 30 + len(OUTSIDE_LAYERS) == 154
    assert len(LAYERWISE_LAYER) * 30 + len(OUTSIDE_LAYERS) == 244


def unfuse_last_mlp(model):  # as a layer whose gate/up could not be fused (PackedLinear)
    model.model.layers[-1].mlp.gate_up = None


def _options(**kw):
    from slipstream.models.llama.forward_triton import TritonOptions

    return TritonOptions(**kw)


@pytest.mark.parametrize("options,prepare", [(None, None), (FUSED_DECODE, None), (LAYERWISE, None),
                                             (_options(fused_decode_max_rows=ROWS), None),
                                             (_options(fused_decode_max_rows=ROWS - 1), None),
                                             (FUSED_DECODE, unfuse_last_mlp)],
                         ids=["default", "fused_decode", "layerwise", "at_rows", "below_rows", "unfused_mlp"])
def test_expected_layer_is_what_the_code_launches(options, prepare):
    """What test_gpu_profiler_sees_the_same_launches_per_layer expects of a layer (expected_layer)
    is what the layer code launches for the same options, the engine's default included (issue 48,
    item 7: the GPU test expected the fused layer's 5 after the default became the 8-launch layer)."""
    model = decode_model(2, options, prepare)
    launches, layer = decode_launches(2, model=model), expected_layer(model, ROWS)
    assert launches[1:1 + len(layer)] == layer  # the first layer (dense in every case), in order
    if prepare is None:  # (an unfused last layer launches its own MLP)
        assert sorted(launches) == sorted(OUTSIDE_LAYERS + 2 * layer)


def test_fused_decode_stops_above_its_rows_and_on_packed_layers():
    """A step of more rows than fused_decode_max_rows (three here) takes the 8-launch layer; so does
    a model with a layer that is not dense."""
    from slipstream.models.llama.forward_triton import TritonOptions

    assert decode_launches(1, TritonOptions(fused_decode_max_rows=3))[1:1 + len(LAYER)] == LAYER
    assert decode_launches(1, TritonOptions(fused_decode_max_rows=2))[1:1 + len(LAYERWISE_LAYER)] == LAYERWISE_LAYER

    launches = decode_launches(2, FUSED_DECODE, prepare=unfuse_last_mlp)
    assert "_norm_qkv_rotary_kernel" not in launches and launches.count("_rotary_kv_kernel") == 2


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
    with pytest.raises(ValueError, match="fused_decode_max_rows"):
        TritonOptions(fused_decode_max_rows=-1)
    with pytest.raises(ValueError, match="fused_decode_max_rows"):
        TritonOptions(fused_decode_max_rows=2.5)
    model = build(tiny_config(), torch.float32, "reference")
    with pytest.raises(TypeError, match="TritonOptions"):
        model.set_kernel_backend("triton", {"fuse_projections": False})


@pytest.mark.cuda
def test_gpu_profiler_sees_the_same_launches_per_layer():
    """The CPU count against torch.profiler's CUDA kernels: one more layer costs what the layer the
    engine's default options pick for a three-row step launches (expected_layer: checked against
    the layer code on the CPU by test_expected_layer_is_what_the_code_launches)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from torch.profiler import ProfilerActivity, profile

    layers: list[list[str]] = []

    def gpu_kernels(num_layers: int) -> list[str]:
        cfg = dataclasses.replace(tiny_config(), num_layers=num_layers)
        model = build(cfg, torch.bfloat16, "triton", device="cuda")  # no options: as the engine builds it
        layers.append(expected_layer(model, ROWS))
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
    assert layers[0] == layers[1]
    assert len(three) - len(two) == len(layers[0]), (two, three)

"""tools/gpu/profile_forward_cuda.py's new paths on the CPU (issue 50): the prefill's FLOP count, the peak
table, a prefill step staged and run on a CPU engine, and the argument path up to "needs a GPU". The
figures come from a lent GPU."""
import asyncio
import importlib.util
import os
import sys

import torch

_TOOLS = os.path.join(os.path.dirname(__file__), "..", "tools", "gpu")


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(_TOOLS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


profile = _tool("profile_forward_cuda")
gpu_peaks = _tool("gpu_peaks")


def test_prefill_flops_of_the_1b_shape():
    from slipstream.models.config import llama_3_2_1b_config

    cfg = llama_3_2_1b_config()
    t = 2048
    per_layer = 2048 * 2048 * 2 + 2 * 2048 * 512 + 3 * 2048 * 8192  # q, o; k, v; gate, up, down
    assert per_layer * 16 == 1_235_814_400 - 128256 * 2048 - 33 * 2048  # every weight but embedding and norms
    attention = 16 * 4 * 2048 * t * (t + 1) // 2  # causal: query i reads i + 1 keys, QKᵀ and PV
    want = 2 * per_layer * 16 * t + attention + 2 * 2048 * 128256
    assert profile.prefill_flops(cfg, t) == want
    assert 4.2e12 < want < 4.3e12  # ~4.26 TFLOP: 40% of an H100's/H200's 989 TFLOP/s is ~10.8 ms


def test_peak_table():
    assert gpu_peaks.dense_bf16_peak("NVIDIA H200") == 989.0
    assert gpu_peaks.dense_bf16_peak("NVIDIA H100 80GB HBM3") == 989.0  # SXM
    assert gpu_peaks.dense_bf16_peak("NVIDIA H100 PCIe") == 756.0
    assert gpu_peaks.dense_bf16_peak("NVIDIA H200 NVL") == 835.0
    assert gpu_peaks.dense_bf16_peak("NVIDIA GeForce RTX 4090") is None


def test_a_prefill_step_stages_and_runs_on_a_cpu_engine():
    from slipstream import Engine, EngineConfig

    async def run():
        async with Engine(EngineConfig(model="tiny-random", device="cpu", max_batch_size=4,
                                       max_num_batched_tokens=256, kv_cache_tokens=1024)) as engine:
            runner = engine._parts.runner
            tensors, found = profile.stage_prefill(runner, 200)
            return runner.forward.logits(tensors), found

    logits, found = asyncio.run(run())
    assert found is None  # (no graphs on the CPU)
    assert logits.shape == (1, 512) and torch.isfinite(logits).all()  # the sampled row: the chunk's last


def test_arguments_of_the_1b_profile_reach_the_gpu_check(capsys):
    rc = profile.main(["--model", "random-llama-3.2-1b", "--batches", "1", "8", "32", "--repeats", "20",
                       "--launch", "triton", "--no-warmup", "--prefill", "2048"])
    out = capsys.readouterr()
    assert "# random-llama-3.2-1b" in out.out  # the section heading: one per model in profile.md
    if not torch.cuda.is_available():
        assert rc == 2 and "needs a GPU" in out.err

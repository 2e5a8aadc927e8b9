"""KV sizing for a model that takes images (issue 37, item 10): the vision tower's peak is part of
the profiled step, and the encoder cache's outputs are reserved before the pool is sized."""
import types

import pytest
import torch
from live_bytes import LiveBytes

from image_util import picture
from slipstream import EngineConfig
from slipstream.models.idefics3.config import ProcessingConfig
from slipstream.models.idefics3.processor import Idefics3Processing
from slipstream.models.moondream.config import MoondreamConfig
from slipstream.models.moondream.serving import MoondreamProcessing
from slipstream.runtime.devices import memory
from slipstream.runtime.devices.memory import engine_reserve

pytest.importorskip("PIL.Image")
TEXT_MODEL = types.SimpleNamespace(carry_heads=None)  # kv_pages asks a model only whether it has carry heads
SIZES = [(20, 30), (64, 64), (100, 150), (500, 90), (90, 500), (3000, 2000), (1000, 1000)]


@pytest.mark.parametrize("processing", [
    Idefics3Processing(ProcessingConfig(longest_edge=128, tile=64), tokens_per_tile=4),
    Idefics3Processing(ProcessingConfig(), tokens_per_tile=81),  # SmolVLM's settings
    MoondreamProcessing(MoondreamConfig.tiny()), MoondreamProcessing(MoondreamConfig())],
    ids=["idefics3-tiny", "smolvlm", "moondream-tiny", "moondream2"])
def test_the_largest_input_bounds_every_image(processing):
    """What the profile encodes: no picture gives the encoder more tiles (crops) or rows."""
    largest = processing.largest_input()
    for i, (w, h) in enumerate(SIZES):
        p = processing.preprocess([picture(w, h, i)])[0]
        assert p.pixel_values.shape[0] <= largest.pixel_values.shape[0] and p.num_image_tokens <= largest.num_image_tokens
    assert tuple(largest.pixel_values.shape[1:]) == tuple(p.pixel_values.shape[1:])


def test_the_reserve_holds_the_encoder_cache_of_a_model_that_takes_images(monkeypatch):
    """kv_pages on a CUDA-kind device (the profile stubbed): the profile is handed the largest image,
    and encoder_cache_tokens rows of the text width are taken off before gpu_memory_utilization."""
    from slipstream.api import assemble
    from slipstream.models.config import smollm2_135m_config

    mcfg = smollm2_135m_config()
    cfg = EngineConfig(model="random-smollm2-135m", device="cuda", dtype="bfloat16", max_batch_size=16,
                       max_num_batched_tokens=512, encoder_cache_tokens=8192)
    free, seen = 40 * 2**30, []
    monkeypatch.setattr(memory, "profile_free_memory", lambda *a, image=None: seen.append(image) or free)
    largest = object()
    processing = types.SimpleNamespace(largest_input=lambda: largest)
    device = types.SimpleNamespace(kind="cuda")
    pages = assemble.kv_pages(cfg, TEXT_MODEL, mcfg, device, 8192, processing)
    text_only = assemble.kv_pages(cfg, TEXT_MODEL, mcfg, device, 8192)
    r = engine_reserve(cfg, mcfg, torch.bfloat16, images=True)
    assert r.encoder_cache == 8192 * mcfg.hidden_size * 2 and engine_reserve(cfg, mcfg, torch.bfloat16).encoder_cache == 0
    per_page = memory.kv_bytes_per_page(mcfg, cfg.page_size, torch.bfloat16)
    assert pages == int((free - r.total) * 0.9) // per_page < text_only
    assert seen == [largest, None]


def test_the_profiled_step_holds_the_vision_towers_peak(tmp_path):
    """The profile (here on the CPU, its allocations counted) runs the largest image through the
    vision tower after the text forward: its peak covers the tower's, however small the text step."""
    from moondream_fixture import tiny_moondream_folder
    from slipstream.models.loading.build import build_model

    model, _, mcfg = build_model(str(tiny_moondream_folder(tmp_path / "md")), "float32", torch.device("cpu"), 0)
    largest = MoondreamProcessing(model.moondream_config).largest_input()
    with torch.no_grad(), LiveBytes() as alone:
        model.encode_image(largest)
    with LiveBytes() as profiled:
        memory.profile_step(model, mcfg, torch.device("cpu"), 8, 8, torch.float32, image=largest)
    with LiveBytes() as text:
        memory.profile_step(model, mcfg, torch.device("cpu"), 8, 8, torch.float32)
    assert text.peak < alone.peak <= profiled.peak

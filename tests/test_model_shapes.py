"""The random-weight Llama-3.2 shapes (`random-llama-3.2-1b`, `-3b`: issue 50): their configs against the
published checkpoints', their parameter counts on the meta device (no weight is allocated), the draw on
the device in the target dtype, and a scaled-down instance through the engine. No 1B weight is drawn here."""
import asyncio

import pytest
import torch

from shape_util import small_llama_3_2
from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.models.config import ON_DEVICE_INIT, RANDOM_CONFIGS
from slipstream.models.llama import build

# meta-llama/Llama-3.2-1B's config.json (the fields config_from_hf reads); 3B differs where LLAMA_3B says
LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
            "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
            "intermediate_size": 8192, "max_position_embeddings": 131072, "num_attention_heads": 32,
            "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256}
LLAMA_3B = {**LLAMA_1B, "head_dim": 128, "hidden_size": 3072, "num_attention_heads": 24, "num_hidden_layers": 28}
SHAPES = {"random-llama-3.2-1b": (LLAMA_1B, 1_235_814_400), "random-llama-3.2-3b": (LLAMA_3B, 3_212_749_824)}


@pytest.mark.parametrize("spec", sorted(SHAPES))
def test_config_is_the_published_checkpoints(spec):
    import dataclasses

    from slipstream.models.loading.hf_loader import config_from_hf

    want, ours = config_from_hf(SHAPES[spec][0], spec, "config.json"), RANDOM_CONFIGS[spec]()
    for f in dataclasses.fields(want):
        if f.name in ("bos_token_id", "eos_token_ids"):  # the byte tokenizer's (1, 2), not 128000 / 128001
            assert (ours.bos_token_id, ours.eos_token_ids) == (1, (2,))
            continue
        assert getattr(ours, f.name) == getattr(want, f.name), f.name
    assert ours.rope_freq_factors is not None and max(ours.rope_freq_factors) == 32.0  # llama3 scaling is on


@pytest.mark.parametrize("spec", sorted(SHAPES))
def test_parameter_count_on_the_meta_device(spec):
    """The weights the engine draws for the spec (build_llama: random_model_weights), shapes only."""
    assert spec in ON_DEVICE_INIT
    weights = build.random_model_weights(spec, RANDOM_CONFIGS[spec](), 0, torch.bfloat16, torch.device("meta"))
    assert "lm_head.weight" not in weights  # tied: the embedding is the lm_head
    assert sum(t.numel() for t in weights.values()) == SHAPES[spec][1]
    assert {t.device.type for t in weights.values()} == {"meta"} and {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_random_weights_on_draws_in_place_seeded_and_scaled():
    cfg = small_llama_3_2()
    a = build.random_weights_on(cfg, 0, torch.bfloat16, "cpu")
    again, other = build.random_weights_on(cfg, 0, torch.bfloat16, "cpu"), build.random_weights_on(cfg, 1, torch.bfloat16, "cpu")
    assert set(a) == set(build.random_weights(cfg, 0))  # the same names as the CPU float32 draw
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in a.values())
    assert all(torch.equal(a[k], again[k]) for k in a) and not torch.equal(a["model.norm.weight"],
                                                                           other["model.norm.weight"])
    up = a["model.layers.0.mlp.down_proj.weight"].float()  # [hidden, intermediate]: 1/sqrt(96)
    assert abs(up.std().item() * cfg.intermediate_size ** 0.5 - 1) < 0.1
    norm = a["model.layers.1.input_layernorm.weight"].float()
    assert abs(norm.mean().item() - 1) < 0.05 and 0.05 < norm.std().item() < 0.15
    assert all(t.device.type == "meta" for t in build.random_weights_on(cfg, 0, torch.bfloat16, "meta").values())


def test_other_random_specs_keep_their_cpu_draw():
    """tiny-random / random-smollm2-135m: the float32 CPU draw the tests' transformers twins reproduce."""
    cfg = RANDOM_CONFIGS["tiny-random"]()
    got = build.random_model_weights("tiny-random", cfg, 0, torch.bfloat16, "meta")
    want = build.random_weights(cfg, 0)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_scaled_down_instance_runs_through_the_engine(monkeypatch):
    cfg = small_llama_3_2()
    monkeypatch.setitem(build.RANDOM, "random-llama-3.2-1b", lambda: cfg)
    build.forget_loaded()  # (the packed load is cached by spec name)

    async def run():
        async with Engine(EngineConfig(model="random-llama-3.2-1b", device="cpu", seed=3, max_batch_size=4,
                                       kv_cache_tokens=1024)) as engine:
            outs = await asyncio.gather(*(engine.complete(p, SamplingParams(max_tokens=5, temperature=0.0,
                                                                            ignore_eos=True))
                                          for p in ("Hello", "a longer prompt, in bytes")))
            return engine.model_config, engine._parts.runner.model.model.embed_tokens.weight, outs

    try:
        config, embed, outs = asyncio.run(run())
        assert [len(o.token_ids) for o in outs] == [5, 5]
        assert config.vocab_size == 512 and config.rope_freq_factors == cfg.rope_freq_factors
        assert torch.equal(embed, build.random_weights_on(cfg, 3, torch.float32, "cpu")["model.embed_tokens.weight"])
    finally:
        build.forget_loaded()

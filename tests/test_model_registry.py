"""Adding a model means registering it (models/registry.py): a family written here, registered from
the test, is built and served by the engine without a line of slipstream changed.

The family, "counting", answers every token with the next byte (a -> b, z -> {): no math, but a real
`Model` (models/base.py) with its own KV layout, which it writes through the runner's KV indices.
"""
import asyncio
import dataclasses

import pytest
import torch
from torch import nn

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.errors import ModelNotFoundError
from slipstream.models import registry
from slipstream.models.base import BuildOptions, ForwardBatch, KVCache, ModelFamily
from slipstream.models.config import tiny_config
from slipstream.models.tokenizers.byte_tokenizer import OFFSET, ByteTokenizer

SPEC = "test-counting"


class CountingModel(nn.Module):
    backend = "reference"
    backends = ("reference",)
    carry_heads = None
    vision = None

    def __init__(self, device: torch.device):
        super().__init__()
        # its own KV layout: one layer, one KV head of width 2
        self.config = dataclasses.replace(tiny_config(), name=SPEC, num_layers=1, num_heads=1, num_kv_heads=1,
                                          head_dim=2, hidden_size=2, intermediate_size=2)
        self.device = device

    def forward(self, batch: ForwardBatch, kv: KVCache) -> torch.Tensor:
        kv.k[0, batch.kv_indices, 0, 0] = batch.input_ids.to(kv.k.dtype)  # (what attention would read)
        ids = batch.input_ids.index_select(0, batch.sample_indices)
        nxt = OFFSET + (ids - OFFSET + 1) % 256  # the next byte
        logits = torch.full((ids.shape[0], self.config.vocab_size), -1e9, device=ids.device)
        logits[torch.arange(ids.shape[0], device=ids.device), nxt] = 0.0
        return logits

    def encode_image(self, image, mask=None) -> torch.Tensor:
        raise TypeError("a text-only model")

    def set_kernel_backend(self, backend: str, options=None) -> None:
        pass

    def set_attention_dtype(self, dtype) -> None:
        pass


def build_counting(spec: str, options: BuildOptions):
    model = CountingModel(options.device)
    return model, ByteTokenizer(model.config.vocab_size), model.config


COUNTING = ModelFamily(name="counting", build=build_counting, claims=lambda spec: spec == SPEC)


@pytest.fixture
def counting():
    registry.register(COUNTING)
    yield COUNTING
    registry.unregister(COUNTING.name)


def config(depth: int) -> EngineConfig:
    return EngineConfig(model=SPEC, pipeline_depth=depth, max_batch_size=4, max_num_batched_tokens=32,
                        kv_cache_tokens=256, page_size=8)


async def answers(depth: int, prompts: list[str]) -> list[str]:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    async with Engine(config(depth)) as engine:
        outs = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        kv = engine._parts.runner.kv
        assert kv.k.shape[0] == 1 and kv.k.shape[2:] == (1, 2)  # the registered model's KV layout
    return [o.text for o in outs]


@pytest.mark.parametrize("depth", [1, 2])
def test_a_registered_family_runs_through_the_engine(counting, depth):
    assert registry.for_spec(SPEC) is counting and registry.get("counting") is counting
    assert registry.for_spec("tiny-random").name == "llama"  # what it does not claim goes on as before
    assert asyncio.run(answers(depth, ["abc", "xy", "hello"])) == ["defgh", "z{|}~", "pqrst"]


def test_an_unregistered_spec_is_not_found():
    assert "counting" not in registry.names()
    with pytest.raises(ModelNotFoundError):
        asyncio.run(answers(1, ["abc"]))


def test_a_name_registers_once(counting):
    with pytest.raises(ValueError, match="registered already"):
        registry.register(counting)

"""SmolLM2-135M (the default model) against transformers on the same GGUF, float32, offline."""
import asyncio

import pytest
import torch

from slipstream import Engine, EngineConfig, SamplingParams
from slipstream.models.base import KVCache
from slipstream.models.llama.model import LlamaForCausalLM
from host_batch import Chunk, host_batch

PROMPTS = [
    "The quick brown fox",
    "What is 12345 + 678? The answer is",
    "Ünïcødé text, 日本語 and emoji 🚀 mixed:",
    "def fibonacci(n):\n    ",
]
CHAT = [[{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "List three colours."}]]


@pytest.fixture(scope="module")
def prompt_ids(loaded):
    tok = loaded.tokenizer
    return [tok.encode(p) for p in PROMPTS] + [tok.encode(tok.apply_chat_template(m)) for m in CHAT]


@pytest.fixture(scope="module")
def ours(loaded):
    return LlamaForCausalLM.from_weights(loaded.config, loaded.weights, torch.float32, "cpu")


def test_prompt_ids_equal_transformers(loaded, prompt_ids):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(loaded.path.parent), gguf_file=loaded.path.name)
    for text, ids in zip(PROMPTS, prompt_ids):
        assert ids == hf_tok(text, add_special_tokens=False)["input_ids"], text
    for msgs, ids in zip(CHAT, prompt_ids[len(PROMPTS):]):
        rendered = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert ids == hf_tok(rendered, add_special_tokens=False)["input_ids"]


def test_last_position_logits_within_1e3(loaded, ours, hf_model, prompt_ids):
    page = 16
    kv = KVCache(loaded.config, num_pages=64, page_size=page, dtype=torch.float32, device="cpu")
    next_page = 1
    for ids in prompt_ids:
        n_pages = -(-len(ids) // page)
        pages = list(range(next_page + n_pages - 1, next_page - 1, -1))  # reversed: not contiguous
        next_page += n_pages
        batch, _ = host_batch([Chunk(tokens=ids, start_pos=0, pages=pages)], page, 16)
        got = ours(batch, kv)[0]
        with torch.no_grad():
            want = hf_model(torch.tensor([ids])).logits[0, -1].float()
        assert (got - want).abs().max().item() < 1e-3


def hf_greedy(hf_model, ids, n):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_32_tokens_equal_transformers_through_the_engine(hf_model, prompt_ids):
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)

    async def run():
        async with Engine(EngineConfig(model="smollm2-135m", pipeline_depth=2)) as engine:
            return await asyncio.gather(*(engine.complete(ids, params) for ids in prompt_ids))

    outs = asyncio.run(run())
    for ids, out in zip(prompt_ids, outs):
        assert out.token_ids == hf_greedy(hf_model, ids, 32)

"""Qwen3 (q/k norms), sliding-window attention (Mistral: every layer; Qwen2 `use_sliding_window`: the
layers from `max_window_layers` on), Phi-3 and Gemma 3 (a local and a global layer) against transformers,
from a Hugging Face folder and from a GGUF.

Random tiny weights (model_families.py); the window (SLIDING_WINDOW) is shorter than the prompts and
the generations. The engine runs greedy with prefix caching on (a repeated prompt hits it) and a KV
pool small enough to preempt, at depth 1 and 2.
"""
import asyncio
import dataclasses

import pytest
import torch
from family_chat import GEMMA3_CHAT
from model_families import (GEMMA3_SCALAR, GEMMA3_SOFTCAP, LONGROPE, PHI4_ROPE, SLIDING_WINDOW, byte_vocab, hf_model,
                            special_ids, write_gguf, write_hf_folder)
from test_model_families import last_logits

from slipstream.models.kernels.cpu_kernels import native_kernels
from slipstream.models.llama.model import LlamaForCausalLM
from slipstream.models.loading.loader import load_model

# family -> GGUF architecture (None: the layout has no GGUF form: a window on some layers only)
FAMILIES = {"qwen3": "qwen3", "mistral-sw": "llama", "qwen2-sw": None, "phi3": "phi3", "phi4": "phi3",
            "gemma3": "gemma3"}
NEW_TOKENS = 64


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    model = hf_model(name, len(vocab.tokens), seed=20 + list(FAMILIES).index(name), bos=bos, eos=eos)
    root = tmp_path_factory.mktemp(name)
    gguf_path = root / f"{name}.gguf"
    write_gguf(gguf_path, FAMILIES[name] or "qwen2", model, vocab, pre="qwen2")  # (also the folder's tokenizer)
    folder = root / f"{name}-hf"
    write_hf_folder(folder, model, gguf_path)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, len(vocab.tokens) - 3, (n,), generator=g).tolist() for n in (5, 23, 40)]
    prompts.append(prompts[2])  # the same prompt again: a prefix-cache hit
    with torch.no_grad():
        want = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts[:3]]
    assert all(len(set(w)) > 8 for w in want)  # (not a degenerate repeat: the tokens depend on the attention)
    return {"name": name, "model": model, "folder": folder, "gguf": gguf_path if FAMILIES[name] else None,
            "prompts": prompts, "want": want + [want[2]]}


def test_config(family):
    config = load_model(str(family["folder"])).config
    assert config.qk_norm == (family["name"] in ("qwen3", "gemma3"))
    windows = [config.window(i) for i in range(config.num_layers)]
    assert windows == {"qwen3": [None, None], "mistral-sw": [SLIDING_WINDOW] * 2, "gemma3": [SLIDING_WINDOW, None],
                       "qwen2-sw": [None, SLIDING_WINDOW], "phi3": [None, None], "phi4": [None, None]}[family["name"]]
    assert config.rotary_dim == (12 if family["name"] == "phi4" else None)
    gemma = family["name"] == "gemma3"
    assert (config.hidden_act, config.sandwich_norms, config.embed_scale, config.rope_local_theta,
            config.attn_scale, config.final_logit_softcap) == (
        ("gelu_tanh", True, True, 10000.0, GEMMA3_SCALAR ** -0.5, GEMMA3_SOFTCAP) if gemma
        else ("silu", False, False, None, None, None))
    assert (config.rope_long_from, config.rope_long_factors) == {
        "phi3": (128, tuple(LONGROPE["long_factor"])), "phi4": (128, tuple(PHI4_ROPE["long_factor"]))}.get(
        family["name"], (None, None))
    if family["gguf"] is not None:
        from_gguf = load_model(str(family["gguf"])).config  # (its floats went through float32)
        rounded = ("rms_norm_eps", "rope_freq_factors", "rope_long_factors", "rope_attention_factor", "attn_scale")
        for f in rounded:
            ours, theirs = getattr(from_gguf, f), getattr(config, f)
            assert ours == theirs if theirs is None else ours == pytest.approx(theirs, rel=1e-6), f
        assert from_gguf == dataclasses.replace(config, name=family["gguf"].stem,
                                                **{f: getattr(from_gguf, f) for f in rounded})


def _sources(family):
    return ["folder"] + (["gguf"] if family["gguf"] is not None else [])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_logits_match_transformers(family, backend):
    """Prefill logits at the last position, the prompts longer than the window included."""
    if backend == "cpu" and native_kernels() is None:
        pytest.skip("no compiled CPU kernels")
    for source in _sources(family):
        loaded = load_model(str(family[source]))
        ours = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, torch.float32, "cpu")
        ours.set_kernel_backend(backend)
        for ids in family["prompts"][:3]:
            with torch.no_grad():
                want = family["model"](torch.tensor([ids])).logits[0, -1].float()
            assert (last_logits(ours, ids) - want).abs().max().item() < 1e-4, (source, len(ids))


def test_longrope_tables():
    """Positions from original_max_position_embeddings on take the long factors; cos/sin carry the
    attention factor everywhere (what transformers computes for a sequence longer than the switch)."""
    import math

    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from slipstream.models.kernels.rotary import RotaryEmbedding
    from slipstream.models.loading.hf_loader import config_from_hf

    hf = Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    original_max_position_embeddings=128, rope_parameters=dict(LONGROPE), vocab_size=300,
                    pad_token_id=0)
    ours = config_from_hf(hf.to_dict() | {"architectures": ["Phi3ForCausalLM"]}, "phi3", "config.json")
    rope = RotaryEmbedding(ours)
    for seq_len, positions in ((100, torch.arange(0, 128)), (400, torch.arange(128, 512))):
        inv, scale = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=seq_len)
        freqs = torch.outer(positions.float(), inv)
        want = torch.cat([freqs, freqs], -1).cos() * scale
        assert scale == pytest.approx(math.sqrt(1 + math.log(4) / math.log(128)))
        assert (rope.cos[positions] - want).abs().max().item() < 1e-6


def test_the_window_is_not_a_no_op(family):
    """Guards the test above: without the window (the q/k norms, LongRoPE's factors) logits move visibly."""
    loaded = load_model(str(family["folder"]))
    if family["name"] in ("phi3", "phi4"):  # (phi4: every dim rotating, with the default frequencies)
        plain = dataclasses.replace(loaded.config, rope_freq_factors=None, rope_long_factors=None, rope_long_from=None,
                                    rope_attention_factor=1.0, rotary_dim=None)
        weights = loaded.weights
    elif family["name"] == "qwen3":
        plain = dataclasses.replace(loaded.config, qk_norm=False)
        weights = {k: v for k, v in loaded.weights.items() if "_norm" not in k or "layernorm" in k}
    elif family["name"] == "gemma3":  # each of Gemma's options on its own
        ids = family["prompts"][2]
        with torch.no_grad():
            want = family["model"](torch.tensor([ids])).logits[0, -1].float()
        for change in (dict(sliding_window=None, sliding_layers=None), dict(rope_local_theta=None),
                       dict(attn_scale=None), dict(final_logit_softcap=None), dict(embed_scale=False),
                       dict(hidden_act="silu")):
            ours = LlamaForCausalLM.from_weights(dataclasses.replace(loaded.config, **change), loaded.weights,
                                                 torch.float32, "cpu")
            assert (last_logits(ours, ids) - want).abs().max().item() > 1e-3, change
        return
    else:
        plain, weights = dataclasses.replace(loaded.config, sliding_window=None, sliding_layers=None), loaded.weights
    ours = LlamaForCausalLM.from_weights(plain, weights, torch.float32, "cpu")
    ids = family["prompts"][2]
    assert len(ids) > 2 * SLIDING_WINDOW and len(ids) + NEW_TOKENS <= 128  # (the LongRoPE switch: 128)
    with torch.no_grad():
        want = family["model"](torch.tensor([ids])).logits[0, -1].float()
    assert (last_logits(ours, ids) - want).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_gemma3_gguf_layout_is_llama_cpps(family):
    """transformers' own GGUF reader (llama.cpp's gemma3 conventions: the norms stored as 1 + weight, the
    sandwich norms' names) reads our file's tensors back as the original model's."""
    from transformers import AutoModelForCausalLM

    path = family["gguf"]
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    want, got = family["model"].state_dict(), theirs.state_dict()
    assert set(got) == set(want)
    assert max((got[k] - want[k]).abs().max().item() for k in want) < 1e-6


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_gemma3_chat_template_from_the_folder(family, tmp_path):
    """The folder's chat template (tokenizer_config.json) renders as transformers renders it: system
    prompt folded into the first turn, `model` for the assistant, text parts, the generation prompt."""
    import json
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "gemma3-chat"
    shutil.copytree(family["folder"], folder)
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tcfg, "chat_template": GEMMA3_CHAT}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    ours, theirs = load_model(str(folder)).tokenizer, AutoTokenizer.from_pretrained(str(folder))
    chats = [[{"role": "user", "content": " Hi there "}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "4"}, {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}]}]]
    for msgs in chats:
        for gen in (True, False):
            want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == want
    assert "<start_of_turn>model\n" in ours.apply_chat_template(chats[1])


def _generate(spec: str, prompts, depth: int, device: str = "cpu", dtype: str = "float32", kv_tokens: int = 128):
    from slipstream import Engine, EngineConfig, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    # 8 pages of 16 for 4 sequences of up to 104 tokens: preemption; prefix caching on (the default)
    config = EngineConfig(model=spec, device=device, dtype=dtype, pipeline_depth=depth, kv_cache_tokens=kv_tokens,
                          page_size=16)

    async def run():
        async with Engine(config) as engine:
            outs = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
            return [o.token_ids for o in outs], engine._parts.loop.planner.num_preemptions

    return asyncio.run(run())


def test_engine_greedy_equals_transformers(family):
    """64 greedy tokens of 4 prompts (one repeated), preempting, at depth 2 from the folder, depth 1 from
    the folder, and from the GGUF: all transformers' tokens."""
    # every layer windowed: pages before the window go back (about 3 a sequence), so a pool of 7 (what
    # the longest request needs) makes the 4 sequences preempt
    kv = 112 if family["name"] == "mistral-sw" else 128
    got, preemptions = _generate(str(family["folder"]), family["prompts"], depth=2, kv_tokens=kv)
    assert got == family["want"]
    assert preemptions > 0
    assert _generate(str(family["folder"]), family["prompts"], depth=1, kv_tokens=kv)[0] == got
    if family["gguf"] is not None:
        assert _generate(str(family["gguf"]), family["prompts"], depth=2, kv_tokens=kv)[0] == got


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_greedy_agrees_with_transformers(family, dtype):
    """On the triton backend (graphs, preemption, the prefix-cache hit): float32 gives transformers' tokens
    (on the GPU, in float32); bfloat16 rounds differently from transformers' bf16 (kernels, fused ops, the
    norms' folded 1 + weight), so as in test_cuda_runtime a late near-tie may flip: the first 8 tokens of
    most prompts agree."""
    import copy

    model = copy.deepcopy(family["model"]).to(device="cuda", dtype=getattr(torch, dtype))  # (the fixture's stays)
    with torch.no_grad():
        want = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in family["prompts"]]
    del model
    got, _ = _generate(str(family["folder"]), family["prompts"], depth=2, device="cuda", dtype=dtype)
    if dtype == "float32":
        assert got == want
    else:
        assert sum(g[:8] == w[:8] for g, w in zip(got, want)) >= 3



@pytest.mark.parametrize("family", ["mistral-sw"], indirect=True)
@pytest.mark.parametrize("depth", [1, 2])
def test_pages_outside_the_window_go_back_to_the_pool(family, depth):
    """A request of 87 positions (over 7 windows of 12; every layer windowed) holds at most the pages of
    its window and the ones it is filling, read from the pool at every streamed delta, and its tokens are
    transformers'. Then the same prompt twice at once, the second after the first's first tokens: it maps
    the first's prompt pages from the prefix cache, those the first gave back (to the cache's LRU) and
    those it still holds, which it gives back under the second (a reference each); both give
    transformers' tokens, and nothing stays held. At depth 2 with drafts (speculation)."""
    from slipstream import Engine, EngineConfig, SamplingParams
    from slipstream.params import SpeculativeConfig

    prompt, want = family["prompts"][1], family["want"][1]
    page = 4
    assert len(prompt) + NEW_TOKENS > 4 * SLIDING_WINDOW
    # the window's pages, the partial one before it, the one being filled and what the steps in flight reach
    bound = SLIDING_WINDOW // page + 2 + depth
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    spec = SpeculativeConfig(num_drafts=3, adaptive=False) if depth == 2 else None
    config = EngineConfig(model=str(family["folder"]), device="cpu", pipeline_depth=depth, kv_cache_tokens=256,
                          page_size=page, speculative=spec)

    async def collect(stream, held=None, started=None):
        tokens = []
        async for delta in stream:
            tokens += delta.token_ids
            if held is not None:
                held.append(held_pages())
            if started is not None:
                started.set()
        return tokens

    async def run():
        nonlocal held_pages
        async with Engine(config) as engine:
            planner = engine._parts.loop.planner
            held_pages = planner.pool.num_held
            held: list[int] = []
            alone = await collect(engine.stream(prompt, params), held)
            started = asyncio.Event()
            first = asyncio.create_task(collect(engine.stream(prompt, params), started=started))
            await started.wait()
            second = await collect(engine.stream(prompt, params))
            return alone, held, [await first, second], planner.prefix_cache.hits, held_pages()

    held_pages = None
    alone, held, both, hits, held_after = asyncio.run(run())
    assert alone == want
    assert len(held) > 10 and max(held) <= bound, (max(held), bound)  # (without the release: 22 pages at the end)
    assert both == [want, want]
    assert hits > 0 and held_after == 0

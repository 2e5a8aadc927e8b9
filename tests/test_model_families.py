"""Each supported family (SentencePiece Llama, Qwen2, Llama-3 rope scaling) against transformers.

Random tiny weights are written both as a GGUF and as a Hugging Face folder (see model_families.py);
slipstream loads each, and weights, config, logits and tokenizer are compared with transformers.
"""
import asyncio
import dataclasses

import pytest
import torch
from model_families import (
    LLAMA3_ROPE,
    TEXTS,
    byte_vocab,
    hf_model,
    hf_tokenizer_from_gguf,
    llama3_rope_freqs,
    special_ids,
    spm_vocab,
    write_gguf,
    write_hf_folder,
)

from slipstream.models.kernels.attention import AttentionMetadata
from slipstream.models.base import ForwardBatch, KVCache
from slipstream.models.llama.model import LlamaForCausalLM
from slipstream.models.loading.loader import load_model
from slipstream.models.tokenizers.tokenizer import Tokenizer

# family -> (GGUF architecture, vocabulary kind, tokenizer.ggml.pre)
FAMILIES = {
    "llama-spm": ("llama", "spm", None),  # Llama-2 / TinyLlama / Mistral style: SentencePiece, untied head
    "qwen2": ("qwen2", "byte", "qwen2"),  # q/k/v biases, tied head, NeoX rotary layout in the GGUF
    "llama3-rope": ("llama", "byte", "llama-bpe"),  # Llama-3.1/3.2 rope scaling; GGUF carries rope_freqs
    "linear-rope": ("llama", "byte", "llama-bpe"),  # linear scaling: rope.scaling.* metadata in the GGUF
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    arch, vocab_kind, pre = FAMILIES[name]
    vocab = spm_vocab() if vocab_kind == "spm" else byte_vocab()
    bos, eos = special_ids(vocab)
    kind = name if name in ("llama3-rope", "linear-rope", "qwen2") else "llama"
    model = hf_model(kind, len(vocab.tokens), seed=list(FAMILIES).index(name), bos=bos, eos=eos)
    root = tmp_path_factory.mktemp(name)
    gguf_path = root / f"{name}.gguf"
    rope_freqs = llama3_rope_freqs(16, 10000.0) if name == "llama3-rope" else None
    write_gguf(gguf_path, arch, model, vocab, rope_freqs=rope_freqs, pre=pre)
    folder = root / f"{name}-hf"
    write_hf_folder(folder, model, gguf_path)
    return {"name": name, "model": model, "gguf": gguf_path, "folder": folder,
            "from_gguf": load_model(str(gguf_path)), "from_folder": load_model(str(folder))}


@pytest.mark.parametrize("source", ["from_gguf", "from_folder"])
def test_weights_equal_transformers(family, source):
    loaded, theirs = family[source], family["model"].state_dict()
    tied = family["model"].config.tie_word_embeddings
    assert set(loaded.weights) == set(theirs) - ({"lm_head.weight"} if tied else set())
    for name, t in loaded.weights.items():
        assert torch.equal(t, theirs[name].float()), name


def test_configs_agree(family):
    a, b = family["from_gguf"].config, family["from_folder"].config
    hf = family["model"].config
    assert a.architecture == b.architecture == ("qwen2" if family["name"] == "qwen2" else "llama")
    assert a.attention_bias == b.attention_bias == (family["name"] == "qwen2")
    assert a.eos_token_ids == b.eos_token_ids == (hf.eos_token_id,)
    assert a.bos_token_id == b.bos_token_id == hf.bos_token_id
    for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "head_dim", "rope_theta", "max_position_embeddings", "tie_word_embeddings"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.rms_norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    if family["name"] == "llama3-rope":
        assert a.rope_freq_factors == pytest.approx(b.rope_freq_factors, rel=1e-6)
        assert a.rope_freq_factors[0] == 1.0 and a.rope_freq_factors[-1] == LLAMA3_ROPE["factor"]
        assert 1.0 < a.rope_freq_factors[1] < LLAMA3_ROPE["factor"]  # the blended band is exercised
    elif family["name"] == "linear-rope":
        assert a.rope_freq_factors == b.rope_freq_factors == (4.0,) * 8
    else:
        assert a.rope_freq_factors is None and b.rope_freq_factors is None


def last_logits(model: LlamaForCausalLM, ids: list[int], page: int = 8) -> torch.Tensor:
    """One prefill through slipstream's paged forward; float32 logits at the last position."""
    n = len(ids)
    n_pages = -(-n // page)
    pages = list(range(n_pages, 0, -1))  # reversed: a non-contiguous page table
    kv = KVCache(model.config, num_pages=n_pages + 1, page_size=page, dtype=torch.float32, device="cpu")
    slots = [pages[i // page] * page + i % page for i in range(n)]
    batch = ForwardBatch(torch.tensor(ids), torch.arange(n), torch.tensor(slots), torch.tensor([n - 1]),
                         AttentionMetadata([0, n], [n], [pages], page))
    with torch.no_grad():
        return model(batch, kv)[0]


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (5, 23, 70)]


@pytest.mark.parametrize("source", ["from_gguf", "from_folder"])
def test_logits_match_transformers(family, source):
    loaded = family[source]
    ours = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, torch.float32, "cpu")
    for ids in _prompts(loaded.config.vocab_size):
        with torch.no_grad():
            want = family["model"](torch.tensor([ids])).logits[0, -1].float()
        assert (last_logits(ours, ids) - want).abs().max().item() < 1e-4, len(ids)


def test_rope_scaling_is_not_a_no_op(family):
    """Guards the test above: without the rope factors, logits of the scaled families move visibly."""
    if "rope" not in family["name"]:
        pytest.skip("only the rope-scaled families")
    loaded = family["from_gguf"]
    plain = dataclasses.replace(loaded.config, rope_freq_factors=None)
    ours = LlamaForCausalLM.from_weights(plain, loaded.weights, torch.float32, "cpu")
    ids = _prompts(plain.vocab_size)[2]
    with torch.no_grad():
        want = family["model"](torch.tensor([ids])).logits[0, -1].float()
    assert (last_logits(ours, ids) - want).abs().max().item() > 1e-3


def test_transformers_reads_our_gguf_layout_the_same_way(family):
    """transformers' own GGUF loader (llama.cpp conventions: q/k permutation for llama, none for qwen2)
    gives the same logits. It ignores `rope_freqs`, so the rope-scaled family is checked above only."""
    if "rope" in family["name"]:
        pytest.skip("transformers' GGUF loader drops rope_freqs and llama rope.scaling metadata")
    from transformers import AutoModelForCausalLM

    path = family["gguf"]
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    loaded = family["from_gguf"]
    ours = LlamaForCausalLM.from_weights(loaded.config, loaded.weights, torch.float32, "cpu")
    ids = _prompts(loaded.config.vocab_size)[1]
    with torch.no_grad():
        want = theirs(torch.tensor([ids])).logits[0, -1].float()
    assert (last_logits(ours, ids) - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_tokenizer_matches_transformers(family, source):
    if source == "gguf":
        ours, theirs = family["from_gguf"].tokenizer, hf_tokenizer_from_gguf(family["gguf"])
    else:
        from transformers import AutoTokenizer

        ours = Tokenizer.from_file(family["folder"] / "tokenizer.json")
        assert ours.encode("x") == family["from_folder"].tokenizer.encode("x")
        theirs = AutoTokenizer.from_pretrained(str(family["folder"]))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_specifics(family):
    if family["name"] != "llama-spm":
        pytest.skip("SentencePiece family only")
    tok = family["from_gguf"].tokenizer
    ids = tok.encode("the 🤖")
    assert ids[0] == tok.bos_token_id == 1  # BOS by default for SentencePiece vocabularies
    assert tok.id_to_token(ids[1]).startswith("\u2581")  # the prepended space
    assert [tok.id_to_token(i) for i in ids[-4:]] == ["<0xF0>", "<0x9F>", "<0xA4>", "<0x96>"]  # byte fallback
    assert tok.decode(ids, skip_special_tokens=True) == "the 🤖"


def test_engine_greedy_equals_transformers(family):
    """The whole engine (paged KV, pipelined loop) on the GGUF, greedy, against transformers' generate."""
    from slipstream import Engine, EngineConfig, SamplingParams

    ids = _prompts(family["model"].config.vocab_size)[1]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run():
        async with Engine(EngineConfig(model=str(family["gguf"]), device="cpu")) as engine:
            return await engine.complete(ids, params)

    out = asyncio.run(run())
    with torch.no_grad():
        want = family["model"].generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)
    assert out.token_ids == want[0, len(ids):].tolist()

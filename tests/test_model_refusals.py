"""What slipstream cannot run is refused at load time with a typed error naming the file and the reason."""
import json
import shutil

import numpy as np
import pytest
from model_families import byte_vocab, hf_model, special_ids, write_gguf, write_hf_folder

from slipstream.errors import CorruptModelError, UnsupportedArchitectureError
from slipstream.models.loading.gguf_loader import load_gguf
from slipstream.models.loading.hf_loader import load_hf_folder


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("refuse")
    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    model = hf_model("qwen2", len(vocab.tokens), seed=9, bos=bos, eos=eos)
    write_gguf(root / "q.gguf", "qwen2", model, vocab, pre="qwen2")
    write_hf_folder(root / "folder", model, root / "q.gguf")
    return root, model, vocab


GEMMA3 = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_activation": "gelu_pytorch_tanh"}


def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes, match", [
    ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention", "chunked_attention"]},
     "layer_types"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act 'gelu_pytorch_tanh' is not supported"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",  # Phi-4-mini's layout, but 0.7 of 16 is odd
      "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.7}},
     "partial_rotary_factor 0.7 gives 11 rotary dims"),
    ({"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8,
                          "rope_theta": 1e4}}, "'longrope' is supported on Phi-3 only"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": True}, "attention_bias"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},  # (the vision-language one)
     "'Gemma3ForConditionalGeneration' is not supported.*Gemma3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, "
     "Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"),
    ({**GEMMA3, "attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ({**GEMMA3, "use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({**GEMMA3, "hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({**GEMMA3, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention rope_type 'linear'"),
    ({**GEMMA3, "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "'yarn' is not supported"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}, "'dynamic' is not supported"),
    ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}, "MixtralForCausalLM"),
])
def test_hf_folder_refusals(qwen, tmp_path, changes, match):
    folder = _edit_config(qwen[0] / "folder", tmp_path / "edited", **changes)
    with pytest.raises(UnsupportedArchitectureError, match=match) as err:
        load_hf_folder(folder)
    assert "config.json" in str(err.value)


def test_gguf_unsupported_architecture_lists_the_supported(qwen, tmp_path):
    _, model, vocab = qwen
    path = tmp_path / "gemma.gguf"
    write_gguf(path, "gemma2", model, vocab, pre="qwen2")
    with pytest.raises(UnsupportedArchitectureError, match=r"gemma\.gguf: architecture 'gemma2' is not supported "
                                                           r"\(supported: llama, qwen2, qwen3, phi3, gemma3\)"):
        load_gguf(path)


def test_llama3_rope_missing_a_field_is_corrupt(qwen, tmp_path):
    rope = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}  # no low/high_freq_factor
    folder = _edit_config(qwen[0] / "folder", tmp_path / "edited", architectures=["LlamaForCausalLM"],
                          model_type="llama", rope_parameters=rope)
    with pytest.raises(CorruptModelError, match="llama3.*low_freq_factor"):
        load_hf_folder(folder)


def test_llama_with_biases_is_refused_in_both_formats(qwen, tmp_path):
    folder = _edit_config(qwen[0] / "folder", tmp_path / "edited", architectures=["LlamaForCausalLM"],
                          model_type="llama", attention_bias=True)
    with pytest.raises(UnsupportedArchitectureError, match="biases"):
        load_hf_folder(folder)
    _, model, vocab = qwen
    path = tmp_path / "llama-with-bias.gguf"
    write_gguf(path, "llama", model, vocab, pre="llama-bpe")  # qwen2 weights (with q/k/v biases) as "llama"
    with pytest.raises(UnsupportedArchitectureError, match=r"llama-with-bias\.gguf.*attn_[qkv]\.bias"):
        load_gguf(path)


def test_gguf_rope_refusals(qwen, tmp_path):
    _, model, vocab = qwen
    bad = tmp_path / "short-freqs.gguf"
    write_gguf(bad, "qwen2", model, vocab, pre="qwen2", rope_freqs=np.ones(3, np.float32))
    with pytest.raises(CorruptModelError, match=r"short-freqs\.gguf: rope_freqs has 3 entries"):
        load_gguf(bad)
    both = tmp_path / "both.gguf"
    write_gguf(both, "qwen2", model, vocab, pre="qwen2", rope_freqs=np.ones(8, np.float32),
               rope_scaling=("linear", 2.0))
    with pytest.raises(UnsupportedArchitectureError, match="together with rope_freqs"):
        load_gguf(both)
    yarn = tmp_path / "yarn.gguf"
    write_gguf(yarn, "qwen2", model, vocab, pre="qwen2", rope_scaling=("yarn", 4.0))
    with pytest.raises(UnsupportedArchitectureError, match=r"yarn\.gguf: rope scaling 'yarn' is not supported"):
        load_gguf(yarn)


def test_gemma3_gguf_with_attention_softcapping_is_refused(tmp_path):
    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    model = hf_model("gemma3", len(vocab.tokens), seed=9, bos=bos, eos=eos)
    path = tmp_path / "softcap.gguf"
    write_gguf(path, "gemma3", model, vocab, pre="qwen2", extra={"gemma3.attn_logit_softcapping": 50.0})
    with pytest.raises(UnsupportedArchitectureError, match=r"softcap\.gguf: gemma3 with attn_logit_softcapping"):
        load_gguf(path)


def test_gguf_partial_rotary_outside_phi3_is_refused(qwen, tmp_path):
    _, model, vocab = qwen
    path = tmp_path / "partial.gguf"
    write_gguf(path, "qwen2", model, vocab, pre="qwen2", extra={"qwen2.attention.key_length": 16, "qwen2.rope.dimension_count": 8})
    with pytest.raises(UnsupportedArchitectureError, match=r"partial\.gguf: partial rotary \(8 of 16 dims\) is "
                                                           r"supported on phi3 only"):
        load_gguf(path)


def test_gemma3_gguf_window_pattern_of_the_wrong_length_is_corrupt(tmp_path):
    vocab = byte_vocab()
    bos, eos = special_ids(vocab)
    model = hf_model("gemma3", len(vocab.tokens), seed=9, bos=bos, eos=eos)
    model.config.layer_types = ["sliding_attention"] * 3  # (what the writer writes as the pattern: 3 for 2 layers)
    path = tmp_path / "pattern.gguf"
    write_gguf(path, "gemma3", model, vocab, pre="qwen2")
    with pytest.raises(CorruptModelError, match=r"pattern\.gguf: attention\.sliding_window_pattern has 3 entries "
                                                r"for 2 layers"):
        load_gguf(path)

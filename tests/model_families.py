"""Tiny random checkpoints of each supported family, written the way real ones are, no hub needed.

Each family gives a transformers model (the oracle) and the same weights written twice: as a GGUF
(with the `gguf` package's writer, laid out as llama.cpp's converter lays it out) and as a Hugging
Face folder (config.json + safetensors from transformers, tokenizer files saved by transformers'
own tokenizer loaded from that GGUF). Vocabularies are trained on a small corpus with `tokenizers`.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf
import numpy as np
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 2024 there were 12345 apples and 678 pears; in 2025, 99 more.",
    "Hello world! How are you today? I am fine, thanks.",
    "the theory of the thing: there, then, these, those, other, mother, brother",
    "def main():\n    return 42\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048 4096 65536.",
] * 4

TEXTS = [
    "The quick brown fox",
    "Hello world! 12345 apples in 2024.",
    " leading space and  double  spaces",
    "new\nlines\n\nand\ttabs",
    "unseen: Ωmega ∑ 日本語 🤖",
    "<s>inline control</s> text",
    "",
]

_GGUF_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}  # (phi3: fused, as llama.cpp)
# Phi-3's LongRoPE, the switch at 128 positions: the tests' sequences (<= 104) stay on the short side,
# where transformers' per-sequence choice and slipstream's per-position one agree
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]}
# Phi-4-mini's layout: partial rotary (0.75 of head_dim 16: 12 dims, 6 pairs of factors), LongRoPE, tied head
PHI4_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
             "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0], "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0]}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
LINEAR_ROPE = {"rope_type": "linear", "factor": 4.0}


@dataclass
class Vocab:
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None  # SentencePiece
    merges: list[str] | None = None  # byte-level BPE


def spm_vocab(size: int = 200) -> Vocab:
    """A SentencePiece-style BPE vocabulary: <unk> <s> </s>, 256 byte tokens, then pieces by merit."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=size, show_progress=False))
    pieces = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]  # earlier piece = better, as in SentencePiece
    return Vocab(tokens, types, scores=scores)


def byte_vocab(size: int = 400) -> Vocab:
    """A byte-level BPE vocabulary (Qwen2/GPT-2 style) with merges, plus ChatML control tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return Vocab(tokens + specials, [1] * len(tokens) + [3] * 3, merges=merges)


def special_ids(vocab: Vocab) -> tuple[int, int]:
    """(bos, eos) of a vocabulary, as the GGUF writer below records them."""
    if vocab.scores is not None:
        return 1, 2
    return vocab.tokens.index("<|endoftext|>"), vocab.tokens.index("<|im_end|>")


SLIDING_WINDOW = 12  # shorter than the prompts and the generations of the sliding-window families
# Gemma 3's layers: local (windowed, rope base 10000) then global (1e6); the scores' factor from
# query_pre_attn_scalar 24 (not head_dim 16), a final softcap low enough to bend the random logits
GEMMA3_LAYERS = ["sliding_attention", "full_attention"]
GEMMA3_SCALAR = 24
GEMMA3_SOFTCAP = 8.0


def hf_model(family: str, vocab_size: int, seed: int = 0, bos: int = 1, eos: int = 2, hidden: int | None = None,
             sizes: dict[str, int] | None = None):
    """A random transformers model of `family` ("llama", "llama3-rope", "linear-rope", "qwen2", "qwen3",
    "mistral-sw": every layer windowed, "qwen2-sw": layer 0 full, layer 1 windowed, "phi3": fused
    projections and LongRoPE, "phi4": Phi-4-mini's partial rotary, "gemma3": text, GEMMA3_LAYERS), norms and
    biases perturbed. `hidden`: another hidden size (Gemma's 80 is no multiple of a quantized block's 32);
    `sizes`: other config sizes (intermediate_size, num_attention_heads, ...: K-quants' blocks of 256)."""
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  bos_token_id=bos, eos_token_id=eos)
    torch.manual_seed(seed)
    # the newer families' weights 10x transformers' default: with std 0.02 a tiny tied Qwen3 greedily repeats
    # one token, which would hide a wrong attention
    wide = dict(initializer_range=0.2)
    if hidden is not None:
        common["hidden_size"] = hidden
    common.update(sizes or {})
    if family == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1000000.0})
        model = Qwen2ForCausalLM(cfg)
    elif family == "qwen2-sw":
        cfg = Qwen2Config(**common, **wide, tie_word_embeddings=True, use_sliding_window=True, sliding_window=SLIDING_WINDOW,
                          max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        model = Qwen2ForCausalLM(cfg)
    elif family == "qwen3":
        cfg = Qwen3Config(**common, **wide, head_dim=16, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        model = Qwen3ForCausalLM(cfg)
    elif family == "phi3":
        cfg = Phi3Config(**{**common, "max_position_embeddings": 512}, **wide, original_max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=0, rope_parameters=dict(LONGROPE))
        model = Phi3ForCausalLM(cfg)
    elif family == "phi4":
        cfg = Phi3Config(**{**common, "max_position_embeddings": 512}, **wide, original_max_position_embeddings=128,
                         tie_word_embeddings=True, pad_token_id=0, rope_parameters=dict(PHI4_ROPE))
        model = Phi3ForCausalLM(cfg)
    elif family == "gemma3":  # hidden 80: sqrt(hidden) is not a round number
        cfg = Gemma3TextConfig(**{**common, "hidden_size": hidden or 80}, **wide, head_dim=16, tie_word_embeddings=True,
                               pad_token_id=0, sliding_window=SLIDING_WINDOW, layer_types=list(GEMMA3_LAYERS),
                               query_pre_attn_scalar=GEMMA3_SCALAR, final_logit_softcapping=GEMMA3_SOFTCAP,
                               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
        model = Gemma3ForCausalLM(cfg)
    elif family == "mistral-sw":
        cfg = MistralConfig(**common, **wide, head_dim=16, tie_word_embeddings=False, sliding_window=SLIDING_WINDOW,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        model = MistralForCausalLM(cfg)
    else:
        scaling = {"llama3-rope": LLAMA3_ROPE, "linear-rope": LINEAR_ROPE}.get(family, {"rope_type": "default"})
        rope = {"rope_theta": 10000.0, **scaling}
        cfg = LlamaConfig(**common, head_dim=16, tie_word_embeddings=False, rope_parameters=rope)
        model = LlamaForCausalLM(cfg)
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if family == "gemma3" and "post_" in name:  # sublayer outputs large beside the (scaled, tied)
                p.add_(4.0)  # embedding, which would otherwise greedily repeat the input token
            elif family == "gemma3" and "embed" in name:
                p.mul_(0.3)
    return model


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's converter pairs the two RoPE halves of every q/k head (llama architecture only)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GEMMA3_GGUF = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(hf: str, arch: str = "llama") -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    module = ".".join(parts[3:-1])
    names = {**_GGUF_LAYER, **_GEMMA3_GGUF} if arch == "gemma3" else _GGUF_LAYER
    return f"blk.{parts[2]}.{names[module]}.{parts[-1]}"


# K-quant types gguf cannot quantize: write_gguf writes random blocks of them (finite small scales), so the
# file's weights are those blocks, not the model's: for tests that compare a file's loads with each other
RANDOM_BLOCKS = ("Q4_K", "Q5_K", "Q6_K")


def write_gguf(path: Path, arch: str, model, vocab: Vocab, rope_freqs: np.ndarray | None = None,
               pre: str | None = None, quantize: dict | None = None,
               rope_scaling: tuple[str, float] | None = None, extra: dict[str, float | int | list] | None = None) -> None:
    """`quantize` maps GGUF tensor names to a storage type (default: float32); `rope_scaling`
    (type, factor) overrides the scaling metadata taken from the model's config; `extra`: more metadata
    keys (float32, uint32 or an array)."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    gemma = arch == "gemma3"
    rope_parameters = cfg.rope_parameters["full_attention"] if gemma else cfg.rope_parameters
    w.add_rope_freq_base(rope_parameters["rope_theta"])
    if rope_scaling is None and rope_parameters.get("rope_type") == "linear":
        rope_scaling = ("linear", rope_parameters["factor"])
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    partial = (cfg.rope_parameters or {}).get("partial_rotary_factor", 1.0) if not gemma else 1.0
    if partial != 1.0:  # llama.cpp's n_rot (Phi-4-mini: 96 of 128)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(int(head_dim * partial))
    if getattr(cfg, "sliding_window", None) and set(getattr(cfg, "layer_types", None) or ["sliding_attention"]) == {
            "sliding_attention"}:
        w.add_sliding_window(cfg.sliding_window)
    if gemma:  # what llama.cpp's converter writes, plus the pattern, the local base and the scale as keys
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])
        w.add_attention_scale(cfg.query_pre_attn_scalar ** -0.5)
        if cfg.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    for key, value in (extra or {}).items():
        if isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_array(key, value)
    w.add_vocab_size(cfg.vocab_size)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.scores is not None:
        w.add_tokenizer_model("llama")
        w.add_token_scores(vocab.scores)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(True)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre or "default")
        w.add_token_merges(vocab.merges)
        bos, eos = special_ids(vocab)
        w.add_bos_token_id(bos)
        w.add_eos_token_id(eos)
        w.add_add_bos_token(False)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    state = model.state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, t in state.items():
        g = _gguf_name(name, arch)
        t = t.detach().float()
        if gemma and name.endswith("norm.weight"):  # llama.cpp's converter: Gemma's 1 + weight, stored
            t = t + 1
        if arch == "llama" and ".attn_q." in g:
            t = _permute(t, heads)
        elif arch == "llama" and ".attn_k." in g:
            t = _permute(t, kv_heads)
        qtype = (quantize or {}).get(g)
        if qtype is None:
            w.add_tensor(g, t.numpy())
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(g, t.numpy().astype(np.float16))
        elif qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(g, t.numpy())
        elif qtype.name in RANDOM_BLOCKS:  # (gguf has no quantizer for these: random blocks, as the file's weights)
            from quant_util import random_blocks

            rows, cols = t.shape
            w.add_tensor(g, random_blocks(qtype.name, rows, cols, seed=zlib.crc32(g.encode())), raw_dtype=qtype)
        else:
            w.add_tensor(g, gguf.quants.quantize(t.numpy(), qtype), raw_dtype=qtype)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if rope_parameters.get("rope_type") == "longrope":  # as llama.cpp's converter writes Phi-3
        import math

        factor = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(factor) / math.log(cfg.original_max_position_embeddings)))
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_tensor("rope_factors_long.weight", np.array(cfg.rope_parameters["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(cfg.rope_parameters["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_tokenizer_from_gguf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def write_hf_folder(folder: Path, model, gguf_path: Path) -> None:
    """config.json + model.safetensors by transformers; tokenizer files by transformers' GGUF tokenizer."""
    model.save_pretrained(folder)
    hf_tokenizer_from_gguf(gguf_path).save_pretrained(folder)


def llama3_rope_freqs(head_dim: int, theta: float) -> np.ndarray:
    """What llama.cpp's converter writes for LLAMA3_ROPE: one divisor per rotary frequency."""
    import math

    p = LLAMA3_ROPE
    low_wl = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wl = p["original_max_position_embeddings"] / p["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wl = 2 * math.pi / freq
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(p["factor"])
        else:
            s = (p["original_max_position_embeddings"] / wl - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"])
            out.append(1 / ((1 - s) / p["factor"] + s))
    return np.array(out, dtype=np.float32)

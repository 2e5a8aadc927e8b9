"""Loading a Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Phi-3 / Gemma 3 (text) folder (config.json + *.safetensors + tokenizer.json)."""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from slipstream.errors import CorruptModelError, ModelNotFoundError, UnsupportedArchitectureError
from slipstream.models.config import ModelConfig, llama3_rope_factors
from slipstream.models.tokenizers.tokenizer import Tokenizer


def llama_weight_names(config: ModelConfig) -> list[str]:
    """Every tensor a Llama checkpoint must provide, in Hugging Face naming."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if config.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def check_weights(config: ModelConfig, weights: Mapping[str, Any], source: Path | str) -> None:
    """Fail early, naming the file, when a tensor is missing or its shape contradicts the config."""
    missing = [n for n in llama_weight_names(config) if n not in weights]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CorruptModelError(f"{source}: missing tensors {missing[:3]}{more}")
    h, d = config.hidden_size, config.head_dim
    expected = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.layers.0.self_attn.q_proj.weight": (config.num_heads * d, h),
        "model.layers.0.self_attn.k_proj.weight": (config.num_kv_heads * d, h),
        "model.layers.0.mlp.gate_proj.weight": (config.intermediate_size, h),
    }
    for name, shape in expected.items():
        if name in weights and tuple(weights[name].shape) != shape:
            raise CorruptModelError(f"{source}: {name} has shape {tuple(weights[name].shape)}, config implies {shape}")


# HF class -> ModelConfig.architecture (Mistral is Llama with a sliding window)
_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
          "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Gemma3ForCausalLM": "gemma3"}
_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                "gemma3_text": "gemma3"}


def _architecture(cfg: Mapping[str, Any], source: Path | str) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in _ARCHS:
            return _ARCHS[a]
    if not archs and cfg.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[str(cfg["model_type"])]
    arch = archs[0] if archs else cfg.get("model_type")
    raise UnsupportedArchitectureError(f"{source}: architecture {arch!r} is not supported "
                                       f"(supported: {', '.join(sorted(_ARCHS))})")


def _sliding_window(cfg: Mapping[str, Any], arch: str, layers: int,
                    source: Path | str) -> tuple[int | None, tuple[bool, ...] | None]:
    """(window, which layers are windowed) as transformers reads them: Qwen2/Qwen3 window only with
    `use_sliding_window`, the layers from `max_window_layers` on; Mistral every layer; `layer_types`
    (transformers 5) says per layer where present."""
    if arch in ("qwen2", "qwen3"):
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    else:
        window = cfg.get("sliding_window")
    if window is None:
        return None, None
    types = cfg.get("layer_types")
    if types is not None:
        unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
        if unknown or len(types) != layers:
            raise UnsupportedArchitectureError(f"{source}: layer_types {types!r} is not supported "
                                               f"(one of full_attention, sliding_attention per layer)")
        sliding = tuple(t == "sliding_attention" for t in types)
    elif arch in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", 28))
        sliding = tuple(i >= first for i in range(layers))
    elif arch == "gemma3":  # transformers 4's configs: every `sliding_window_pattern`-th layer is global
        pattern = int(cfg.get("sliding_window_pattern", 6))
        sliding = tuple(bool((i + 1) % pattern) for i in range(layers))
    else:
        sliding = (True,) * layers
    if not any(sliding):
        return None, None
    return int(window), None if all(sliding) else sliding


def longrope_from_hf(cfg: Mapping[str, Any], rope: Mapping[str, Any], head_dim: int,
                     source: Path | str) -> dict[str, Any]:
    """ModelConfig's LongRoPE fields (Phi-3): short factors up to original_max_position_embeddings, long
    ones from there, cos/sin scaled by attention_factor (default sqrt(1 + ln(factor) / ln(original)),
    factor = max_position_embeddings / original, as transformers computes them). transformers picks
    one side for a whole sequence by its length; here each position takes its own side, which is the
    same while a sequence stays within original_max_position_embeddings."""
    try:
        original = int(rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        short = tuple(float(f) for f in rope["short_factor"])
        long = tuple(float(f) for f in rope["long_factor"])
        factor = rope.get("factor") or int(cfg["max_position_embeddings"]) / original
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"{source}: rope scaling 'longrope' lacks or mangles a field ({exc!r})") from exc
    if len(short) != head_dim // 2 or len(long) != head_dim // 2:
        raise CorruptModelError(f"{source}: longrope short_factor / long_factor have {len(short)} / {len(long)} "
                                f"entries, head_dim {head_dim} needs {head_dim // 2}")
    return dict(rope_freq_factors=short, rope_long_factors=long, rope_long_from=original,
                rope_attention_factor=float(attention))


def rope_factors_from_hf(rope: Mapping[str, Any], head_dim: int, theta: float,
                         source: Path | str) -> tuple[float, ...] | None:
    """Per-frequency RoPE divisors for the scalings we implement; refuse the others by name."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None, "longrope"):  # (longrope: longrope_from_hf)
        return None
    try:
        if rope_type == "linear":
            return (float(rope["factor"]),) * (head_dim // 2)
        if rope_type == "llama3":
            return llama3_rope_factors(head_dim, theta, float(rope["factor"]), float(rope["low_freq_factor"]),
                                       float(rope["high_freq_factor"]),
                                       int(rope["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"{source}: rope scaling {rope_type!r} lacks or mangles a field ({exc!r})") from exc
    raise UnsupportedArchitectureError(f"{source}: rope scaling {rope_type!r} is not supported "
                                       f"(supported: default, linear, llama3, longrope)")


# Gemma 3 fields that change the function and that this implementation does not compute
_GEMMA3_REFUSED = ("attn_logit_softcapping", "use_bidirectional_attention", "attention_bias")


def gemma3_from_hf(cfg: Mapping[str, Any], source: Path | str) -> tuple[dict[str, Any], Mapping[str, Any]]:
    """Gemma 3's ModelConfig options and its global layers' rope parameters. transformers 5 keeps a
    rope dict per layer type (`rope_parameters.full_attention` / `.sliding_attention`), transformers 4
    `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq`; local layers are never scaled."""
    for f in _GEMMA3_REFUSED:
        if cfg.get(f):
            raise UnsupportedArchitectureError(f"{source}: gemma3 with {f}={cfg[f]!r} is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedArchitectureError(f"{source}: gemma3 hidden_activation {act!r} is not supported "
                                           f"(supported: gelu_pytorch_tanh)")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise UnsupportedArchitectureError(f"{source}: gemma3 rope_parameters.sliding_attention rope_type "
                                               f"{local['rope_type']!r} is not supported (supported: default)")
        local_theta = float(local.get("rope_theta", 10000.0))
        full = {"rope_theta": 1000000.0, **full}
    else:
        full = {"rope_theta": float(cfg.get("rope_theta", 1000000.0)), **(cfg.get("rope_scaling") or {})}
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    cap = cfg.get("final_logit_softcapping")
    options = dict(hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=True,
                   attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5, rope_local_theta=local_theta,
                   final_logit_softcap=None if cap is None else float(cap))
    return options, full


def config_from_hf(cfg: Mapping[str, Any], name: str, source: Path | str) -> ModelConfig:
    """Map a Llama/Mistral/Qwen2/Qwen3 config dict (transformers 4 or 5 layout) to ModelConfig; refuse
    what we cannot run, naming the field."""
    arch = _architecture(cfg, source)
    if arch in ("llama", "qwen3") and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise UnsupportedArchitectureError(f"{source}: {arch} with attention_bias/mlp_bias is not supported "
                                           f"(biases on attention/MLP)")
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        gemma, rope = gemma3_from_hf(cfg, source)
    else:
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"{source}: hidden_act {act!r} is not supported (supported: silu)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    partial = cfg.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    if float(partial) != 1.0 and arch != "phi3":
        raise UnsupportedArchitectureError(f"{source}: partial_rotary_factor {partial!r} (partial rotary) is "
                                           f"supported on Phi-3 / Phi-4 only")
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type == "longrope" and arch != "phi3":
        raise UnsupportedArchitectureError(f"{source}: rope scaling 'longrope' is supported on Phi-3 only")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or (256 if arch == "gemma3" else hidden // heads))
        rotary = int(head_dim * float(partial))  # (as transformers rounds it)
        if rotary % 2 or rotary < 2:
            raise UnsupportedArchitectureError(f"{source}: partial_rotary_factor {partial!r} gives {rotary} rotary "
                                               f"dims of {head_dim}: not an even number")
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        eos = cfg.get("eos_token_id")
        window, sliding = _sliding_window(cfg, arch, int(cfg["num_hidden_layers"]), source)
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch == "gemma3")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple([eos] if isinstance(eos, int) else (eos or [])),
            name=name,
            architecture=arch,
            attention_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3"),
            sliding_window=window,
            sliding_layers=sliding,
            **gemma,
            rotary_dim=None if rotary == head_dim else rotary,
            **(longrope_from_hf(cfg, rope, rotary, source) if rope_type == "longrope"
               else {"rope_freq_factors": rope_factors_from_hf(rope, rotary, theta, source)}),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptModelError(f"{source}: config.json lacks or mangles a field ({exc!r})") from exc


def split_fused(config: ModelConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Phi-3's fused qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up]) as the Llama layer's
    separate projections (row views of the fused tensors: no copy)."""
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    out = {}
    for name, t in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            p = name.removesuffix("qkv_proj.weight")
            out[p + "q_proj.weight"], out[p + "k_proj.weight"], out[p + "v_proj.weight"] = t.split([q, kv, kv])
        elif name.endswith("mlp.gate_up_proj.weight"):
            p = name.removesuffix("gate_up_proj.weight")
            out[p + "gate_proj.weight"], out[p + "up_proj.weight"] = t.split([inter, inter])
        else:
            out[name] = t
    return out


def reorder_rotary(config: ModelConfig, weights: dict[str, Any]) -> dict[str, Any]:
    """Partial rotary: each q/k head's rows (weights and biases) in rotary.partial_rotary_order."""
    from slipstream.models.kernels.rotary import partial_rotary_order, reorder_heads

    assert config.rotary_dim is not None
    order = partial_rotary_order(config.head_dim, config.rotary_dim)
    out = dict(weights)
    for name, t in weights.items():
        for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
            if name.endswith((f"self_attn.{proj}.weight", f"self_attn.{proj}.bias")):
                out[name] = reorder_heads(t, heads, order).contiguous()
    return out


def gemma_norms(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gemma's RMSNorms multiply by `1 + weight`: stored here as that factor (what llama.cpp's GGUFs hold),
    computed in float32 as transformers does, then in the weights' dtype."""
    return {k: (1.0 + v.float()).to(v.dtype) if k.endswith("norm.weight") else v for k, v in weights.items()}


def read_safetensors(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files, converted to `dtype`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder}: no *.safetensors weight files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CorruptModelError(f"{f}: cannot read safetensors ({exc})") from exc
        weights.update({k: v.to(dtype) for k, v in part.items()})
    return weights


def load_hf_folder(
    path: str | Path, dtype: torch.dtype = torch.float32, name: str | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read a HF Llama / Mistral / Qwen2 / Qwen3 folder; tensors are converted to `dtype`, a tied lm_head is dropped."""
    folder = Path(path)
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder}: no such model folder")
    cfg_path, tok_path = folder / "config.json", folder / "tokenizer.json"
    for needed in (cfg_path, tok_path):
        if not needed.is_file():
            raise ModelNotFoundError(f"{needed}: missing from the model folder")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptModelError(f"{cfg_path}: not valid JSON ({exc})") from exc
    if not isinstance(cfg, dict):
        raise CorruptModelError(f"{cfg_path}: expected a JSON object")
    config = config_from_hf(cfg, name or folder.name, cfg_path)
    weights = read_safetensors(folder, dtype)
    if config.architecture == "phi3":
        weights = split_fused(config, weights)
    if config.architecture == "gemma3":
        weights = gemma_norms(weights)
    if config.rotary_dim is not None:
        weights = reorder_rotary(config, weights)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    check_weights(config, weights, folder)
    tokenizer = Tokenizer.from_file(tok_path)
    if not config.eos_token_ids and tokenizer.eos_token_ids:
        config = replace(config, eos_token_ids=tokenizer.eos_token_ids)
    return config, weights, tokenizer


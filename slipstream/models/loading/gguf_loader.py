"""Loading a llama.cpp GGUF file: weights in Hugging Face naming, config and tokenizer.

Architectures `llama` (Mistral included: llama.cpp writes it so), `qwen2` (llama + q/k/v biases) and
`qwen3` (llama + per-head q/k RMSNorm, `attn_q_norm` / `attn_k_norm`) and `phi3` (fused `attn_qkv`, and
`ffn_up` holding gate and up; split into the Llama layer's projections at load, quantized rows
included; LongRoPE from `rope_factors_short` / `rope_factors_long`) and `gemma3` (text: sandwich norms
`post_attention_norm` / `ffn_norm` / `post_ffw_norm`, stored as llama.cpp's converter writes them, with
Gemma's `+ 1` already added; local and global layers by `attention.sliding_window_pattern`, else
llama.cpp's gemma3 default of every 6th layer global; the local rotary base `rope.freq_base_swa`, else
10000). An
`<arch>.attention.sliding_window` key windows every layer's attention. With `quantized=True` every matrix in a
format of quant_formats.QUANTIZED_TYPES is repacked, still quantized, into a QuantWeight; everything
else (and every tensor with `quantized=False`) is dequantised to float. loader.py caches the result.
For `llama`, llama.cpp's converter permutes the rows of q/k projections to its interleaved RoPE
layout; we undo that so the weights equal the original Hugging Face checkpoint's. `qwen2` / `qwen3` files use
llama.cpp's NeoX rotary layout and are stored unpermuted. A `rope_freqs` tensor (Llama-3.1/3.2
scaling, one divisor per rotary frequency) becomes ModelConfig.rope_freq_factors.
"""
from __future__ import annotations

import math
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch

from slipstream.errors import (
    CorruptModelError,
    ModelNotFoundError,
    UnsupportedArchitectureError,
    UnsupportedQuantizationError,
)
from slipstream.logging_setup import load_progress
from slipstream.models.config import ModelConfig
from slipstream.models.loading.hf_loader import check_weights
from slipstream.models.kernels.quant_formats import QUANTIZED_TYPES, QuantWeight, repack
from slipstream.models.tokenizers.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
}
_QK_NORMS = {"attn_q_norm", "attn_k_norm"}
_PHI3_FUSED = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_BIASED = {"attn_q", "attn_k", "attn_v"}  # the only biases of the architectures we load (Qwen2)
ROPE_FREQS = "rope_freqs.weight"
ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "gemma3")
# Gemma 3's norms: its ffn_norm is the MLP's input norm, and two more norm the sublayers' outputs
_GEMMA3_NAMES = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
GEMMA3_SWA_PATTERN = 6  # llama.cpp's gemma3 default: layer i is local unless (i + 1) % 6 == 0
GEMMA3_SWA_THETA = 10000.0


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Hugging Face name of a GGUF tensor, or None when it has no Llama/Qwen2 counterpart (Phi-3: its
    fused names, qkv_proj and gate_up_proj)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if arch == "phi3" and m and m.group(2) in _PHI3_FUSED and m.group(3) == "weight":
        return f"model.layers.{m.group(1)}.{_PHI3_FUSED[m.group(2)]}.weight"
    if arch == "gemma3" and m and m.group(2) in _GEMMA3_NAMES and m.group(3) == "weight":
        return f"model.layers.{m.group(1)}.{_GEMMA3_NAMES[m.group(2)]}.weight"
    if m and m.group(2) in _LAYER_NAMES and (m.group(3) == "weight" or m.group(2) in _BIASED):
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's q/k row permutation.

    llama.cpp stores, per head, the rows as [0, d/2, 1, d/2+1, ...] (pairs interleaved for its
    RoPE); HF keeps the two halves contiguous. View rows as (head, d/2, 2) and swap the last two.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _field_value(field: Any) -> Any:
    return field.contents()


def _open(path: Path) -> Any:
    """GGUFReader, with the gguf package's parse failures turned into our exception types."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except ValueError as exc:
        # An enum lookup failure means a tensor type id newer than the gguf package knows.
        if "GGMLQuantizationType" in str(exc):
            raise UnsupportedQuantizationError(f"{path}: unknown tensor type ({exc})") from exc
        raise CorruptModelError(f"{path}: not a readable GGUF file ({exc})") from exc
    except Exception as exc:  # truncated files surface as IndexError, struct/numpy errors, ...
        raise CorruptModelError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def _rope_factors(meta: dict[str, Any], tensors: dict[str, Any], path: Path, arch: str,
                  head_dim: int) -> tuple[float, ...] | None:
    """Per-frequency RoPE divisors from a `rope_freqs` tensor or linear-scaling metadata."""
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if ROPE_FREQS in tensors:
        if scaling not in (None, "none"):
            raise UnsupportedArchitectureError(f"{path}: rope scaling {scaling!r} together with rope_freqs")
        factors = _dequantize(tensors[ROPE_FREQS], path, torch.float64).flatten().tolist()
        if len(factors) != head_dim // 2:
            raise CorruptModelError(f"{path}: rope_freqs has {len(factors)} entries, head_dim {head_dim} "
                                    f"needs {head_dim // 2}")
        return tuple(factors)
    if scaling in (None, "none"):
        return None
    if scaling == "linear":
        factor = float(meta.get(f"{arch}.rope.scaling.factor") or 1.0)
        return None if factor == 1.0 else (factor,) * (head_dim // 2)
    raise UnsupportedArchitectureError(f"{path}: rope scaling {scaling!r} is not supported "
                                       f"(supported: none, linear, rope_freqs)")


def _config(meta: dict[str, Any], tensors: dict[str, Any], path: Path, eos: tuple[int, ...]) -> ModelConfig:
    """ModelConfig from `<arch>.*` metadata; head_dim from key_length/rope dims when they say so."""
    arch = meta["general.architecture"]

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise CorruptModelError(f"{path}: metadata key {arch}.{key!r} is missing")
        return meta[f"{arch}.{key}"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    rope_dims = get("rope.dimension_count")
    # (phi3: n_rot is Phi-4-mini's partial rotary, the head is hidden / heads)
    head_dim = int(get("attention.key_length") or (None if arch == "phi3" else rope_dims) or hidden // heads)
    rotary = head_dim if rope_dims is None else int(rope_dims)
    if rotary != head_dim and (arch != "phi3" or rotary % 2 or not 2 <= rotary < head_dim):
        raise UnsupportedArchitectureError(f"{path}: partial rotary ({rope_dims} of {head_dim} dims) is supported on "
                                           f"phi3 only, for an even count below head_dim")
    embd = tensors.get("token_embd.weight")
    vocab = get("vocab_size") or (int(embd.shape[1]) if embd is not None else None)
    if vocab is None:
        raise CorruptModelError(f"{path}: cannot tell the vocabulary size")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    window = get("attention.sliding_window")
    longrope: dict[str, Any] = {"rope_freq_factors": _rope_factors(meta, tensors, path, arch, rotary)}
    if all(n in tensors for n in LONGROPE_TENSORS):
        short, long = (tuple(_dequantize(tensors[n], path, torch.float64).flatten().tolist()) for n in LONGROPE_TENSORS)
        original = int(get("rope.scaling.original_context_length") or get("context_length", 2048))
        factor = int(get("context_length", 2048)) / original
        attention = get("rope.scaling.attn_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        if len(short) != rotary // 2 or len(long) != rotary // 2:
            raise CorruptModelError(f"{path}: rope_factors_short / _long have {len(short)} / {len(long)} entries, "
                                    f"{rotary} rotary dims need {rotary // 2}")
        longrope = dict(rope_freq_factors=short, rope_long_factors=long, rope_long_from=original,
                        rope_attention_factor=float(attention))
    layers = int(need("block_count"))
    gemma: dict[str, Any] = {}
    sliding = None
    if arch == "gemma3":
        gemma, sliding = _gemma3(get, layers, hidden, heads, head_dim, window, path)
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        name=path.name.removesuffix(".gguf"),
        architecture=arch,
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3"),
        rotary_dim=None if rotary == head_dim else rotary,
        sliding_window=None if window is None else int(window),
        sliding_layers=sliding,
        **longrope,
        **gemma,
    )


def _gemma3(get, layers: int, hidden: int, heads: int, head_dim: int, window: Any,
            path: Path) -> tuple[dict[str, Any], tuple[bool, ...] | None]:
    """Gemma 3's options and which layers are local, read as llama.cpp reads them: the scores' factor
    from `attention.scale` where present, else llama.cpp's rule (1/sqrt(head_dim); 1/sqrt(hidden/heads) for
    the 62-layer 27B, whose query_pre_attn_scalar is that)."""
    if get("attn_logit_softcapping"):
        raise UnsupportedArchitectureError(f"{path}: gemma3 with attn_logit_softcapping (attention softcapping) "
                                           f"is not supported")
    sliding = None
    if window:
        pattern = get("attention.sliding_window_pattern", GEMMA3_SWA_PATTERN)
        if isinstance(pattern, (list, tuple)):
            if len(pattern) != layers:
                raise CorruptModelError(f"{path}: attention.sliding_window_pattern has {len(pattern)} entries for "
                                        f"{layers} layers")
            sliding = tuple(bool(p) for p in pattern)
        else:
            sliding = tuple(bool((i + 1) % int(pattern)) for i in range(layers))
    scale = get("attention.scale")
    if scale is None:
        scale = (hidden // heads) ** -0.5 if layers == 62 else head_dim ** -0.5
    cap = get("final_logit_softcapping")
    return dict(hidden_act="gelu_tanh", sandwich_norms=True, embed_scale=True, attn_scale=float(scale),
                rope_local_theta=float(get("rope.freq_base_swa", GEMMA3_SWA_THETA)),
                final_logit_softcap=float(cap) if cap else None), sliding


# Rows dequantised at a time. A whole tensor at once holds several float32 temporaries of its full
# size: measured for SmolLM2's 108 MB embedding (Q4_1), peak RSS +329 MB at once, +145 MB in chunks.
DEQUANT_CHUNK_ROWS = 4096


def _dequantize(tensor: Any, path: Path, dtype: torch.dtype) -> torch.Tensor:
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    data = tensor.data
    try:
        if data.ndim >= 2 and len(shape) >= 2 and data.shape[0] == shape[0]:
            out = np.empty(shape, dtype=np.float32)
            for i in range(0, shape[0], DEQUANT_CHUNK_ROWS):
                rows = out[i:i + DEQUANT_CHUNK_ROWS]
                rows[...] = dequantize(data[i:i + DEQUANT_CHUNK_ROWS], tensor.tensor_type).reshape(rows.shape)
        else:
            out = np.array(dequantize(data, tensor.tensor_type), dtype=np.float32).reshape(shape)  # a copy:
            # never a view into the read-only memory map
    except NotImplementedError as exc:
        raise UnsupportedQuantizationError(
            f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be dequantised"
        ) from exc
    except ValueError as exc:  # data shorter than the header claims
        raise CorruptModelError(f"{path}: tensor {tensor.name!r} data is malformed ({exc})") from exc
    return torch.from_numpy(out).to(dtype)


def _repack(tensor: Any, path: Path, permute_rows=None) -> QuantWeight | None:
    """The tensor still quantized, or None when its type (or shape) has no quantized container.
    `permute_rows` reorders the rows of its raw blocks first (a row of blocks is one matrix row)."""
    name = tensor.tensor_type.name
    if name not in QUANTIZED_TYPES or len(tensor.shape) != 2 or tensor.data.ndim != 2:
        return None
    raw = tensor.data
    if permute_rows is not None:
        raw = permute_rows(torch.from_numpy(np.array(raw))).numpy()
    try:
        return repack(name, raw, int(tensor.shape[0]))
    except ValueError as exc:  # data shorter than the header claims
        raise CorruptModelError(f"{path}: tensor {tensor.name!r} data is malformed ({exc})") from exc


def _split_fused(tensor: Any, target: str, config: ModelConfig, path: Path, quantized: bool,
                 dtype: torch.dtype) -> dict[str, torch.Tensor | QuantWeight]:
    """A Phi-3 fused matrix as its parts, by HF name: each part's rows repacked still quantized where
    the type allows (a row of blocks is one matrix row), else dequantised."""
    from slipstream.models.loading.hf_loader import split_fused

    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    names: tuple[str, ...]
    sizes: tuple[int, ...]
    if target.endswith("qkv_proj.weight"):
        prefix, names, sizes = target.removesuffix("qkv_proj.weight"), ("q_proj", "k_proj", "v_proj"), (q, kv, kv)
    else:
        prefix, names, sizes = target.removesuffix("gate_up_proj.weight"), ("gate_proj", "up_proj"), (inter, inter)
    from slipstream.models.kernels.rotary import partial_rotary_order, reorder_heads

    # partial rotary (Phi-4-mini): q's and k's rows in the order the rotation needs (hf_loader.reorder_rotary)
    order = None if config.rotary_dim is None else partial_rotary_order(config.head_dim, config.rotary_dim)
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}

    def rows(t: torch.Tensor, name: str) -> torch.Tensor:
        return t if order is None or name not in heads else reorder_heads(t, heads[name], order)

    out: dict[str, torch.Tensor | QuantWeight] = {}
    at = 0
    for name, size in zip(names, sizes):
        part = _repack(tensor, path, lambda t, a=at, b=at + size, n=name: rows(t[a:b], n)) if quantized else None
        at += size
        if part is None:  # (a type without a quantized container: the dense split below)
            out = {}
            break
        out[f"{prefix}{name}.weight"] = part
    if out:
        return out
    # (own storage each: the weight cache stores tensors that share none)
    return {k: rows(v, k.split(".")[-2]).clone()
            for k, v in split_fused(config, {target: _dequantize(tensor, path, dtype)}).items()}


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32, quantized: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantWeight], Tokenizer]:
    """Read config, HF-named weights and tokenizer from a llama / qwen2 / qwen3 GGUF: dequantised to `dtype`,
    or, with `quantized`, kept quantized where quant_formats can (float32 elsewhere)."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such GGUF file")
    start = time.perf_counter()
    log.info("gguf_load_start", path=str(path), size_bytes=path.stat().st_size)
    reader = _open(path)
    try:
        meta = {name: _field_value(f) for name, f in reader.fields.items()}
    except Exception as exc:
        raise CorruptModelError(f"{path}: metadata cannot be decoded ({exc})") from exc
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(f"{path}: architecture {arch!r} is not supported "
                                           f"(supported: {', '.join(ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    # The reader's parsed fields (every token and merge as numpy parts) cost ~85 MB for a 49k
    # vocabulary; everything needed is in `meta` now, so drop them before the weights arrive.
    reader.fields.clear()
    tokenizer = Tokenizer.from_gguf_fields(
        {k: v for k, v in meta.items() if k.startswith("tokenizer.")}, source=str(path)
    )
    config = _config(meta, tensors, path, tokenizer.eos_token_ids)

    weights: dict[str, torch.Tensor | QuantWeight] = {}
    for name, tensor in load_progress(tensors.items(), len(tensors), "loading weights"):
        if name == ROPE_FREQS or name in LONGROPE_TENSORS:
            continue  # already in the config's rope fields
        target = hf_name(name, arch)
        qk_norm = any(f".{n}." in name for n in _QK_NORMS)
        if target is None or (target.endswith(".bias") and not config.attention_bias) or (qk_norm and not config.qk_norm):
            raise UnsupportedArchitectureError(f"{path}: tensor {name!r} has no {arch} counterpart")
        permute = None
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            permute = lambda t, heads=heads: unpermute_qk(t, heads)  # noqa: E731
        elif config.rotary_dim is not None and (".attn_q." in name or ".attn_k." in name):  # (partial rotary)
            from slipstream.models.kernels.rotary import partial_rotary_order, reorder_heads

            heads, order = (config.num_heads if ".attn_q." in name else config.num_kv_heads,
                            partial_rotary_order(config.head_dim, config.rotary_dim))
            permute = lambda t, heads=heads, order=order: reorder_heads(t, heads, order)  # noqa: E731
        if target.endswith(("qkv_proj.weight", "gate_up_proj.weight")):  # Phi-3: split into the Llama names
            weights.update(_split_fused(tensor, target, config, path, quantized, dtype))
            continue
        packed = _repack(tensor, path, permute) if quantized else None
        if packed is not None:
            weights[target] = packed
            continue
        w = _dequantize(tensor, path, dtype)
        if permute is not None:
            w = permute(w)
        weights[target] = w
    check_weights(config, weights, path)
    log.info("gguf_load_done", path=str(path), tensors=len(weights),
             seconds=round(time.perf_counter() - start, 2))
    return config, weights, tokenizer


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """Only the tokenizer of a GGUF file (no weights are dequantised), e.g. for tools and tests."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such GGUF file")
    reader = _open(path)
    fields = {k: _field_value(f) for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    return Tokenizer.from_gguf_fields(fields, source=str(path))

"""Loading a llama.cpp GGUF file: dequantised weights in Hugging Face naming, config and tokenizer.

Weights are dequantised once at load time (the engine computes in float), so a Q4 file costs full
float memory. llama.cpp's converter permutes the rows of q/k projections to its interleaved RoPE
layout; we undo that so the weights equal the original Hugging Face checkpoint's.
"""
from __future__ import annotations

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
from slipstream.models.hf_loader import check_weights
from slipstream.models.tokenizer import Tokenizer

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
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def hf_name(gguf_name: str) -> str | None:
    """Hugging Face Llama name of a GGUF tensor, or None when it has no Llama counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
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


def _config(meta: dict[str, Any], tensors: dict[str, Any], path: Path, eos: tuple[int, ...]) -> ModelConfig:
    """ModelConfig from `llama.*` metadata; head_dim from key_length/rope dims when they say so."""
    def need(key: str) -> Any:
        if key not in meta:
            raise CorruptModelError(f"{path}: metadata key {key!r} is missing")
        return meta[key]

    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none") or "rope_freqs.weight" in tensors:
        raise UnsupportedArchitectureError(f"{path}: rope scaling ({scaling or 'rope_freqs'}) is not supported")
    hidden, heads = int(need("llama.embedding_length")), int(need("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length") or meta.get("llama.rope.dimension_count") or hidden // heads)
    rope_dims = meta.get("llama.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise UnsupportedArchitectureError(f"{path}: partial rotary ({rope_dims} of {head_dim} dims) is not supported")
    embd = tensors.get("token_embd.weight")
    vocab = meta.get("llama.vocab_size") or (int(embd.shape[1]) if embd is not None else None)
    if vocab is None:
        raise CorruptModelError(f"{path}: cannot tell the vocabulary size")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("llama.feed_forward_length")),
        num_layers=int(need("llama.block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(meta.get("llama.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos,
        name=path.name.removesuffix(".gguf"),
    )


def _dequantize(tensor: Any, path: Path, dtype: torch.dtype) -> torch.Tensor:
    from gguf.quants import dequantize

    try:
        arr = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise UnsupportedQuantizationError(
            f"{path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, which cannot be dequantised"
        ) from exc
    except ValueError as exc:  # data shorter than the header claims
        raise CorruptModelError(f"{path}: tensor {tensor.name!r} data is malformed ({exc})") from exc
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims fastest-first
    arr = np.ascontiguousarray(arr, dtype=np.float32).reshape(shape)
    if not arr.flags.writeable:  # a view into the read-only memory map (F32 tensors)
        arr = arr.copy()
    return torch.from_numpy(arr).to(dtype)


def load_gguf(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """Read config, dequantised HF-named weights and tokenizer from a llama-architecture GGUF."""
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
    if arch != "llama":
        raise UnsupportedArchitectureError(f"{path}: architecture {arch!r} is not supported (need 'llama')")
    tensors = {t.name: t for t in reader.tensors}
    tokenizer = Tokenizer.from_gguf_fields(
        {k: v for k, v in meta.items() if k.startswith("tokenizer.")}, source=str(path)
    )
    config = _config(meta, tensors, path, tokenizer.eos_token_ids)

    weights: dict[str, torch.Tensor] = {}
    for name, tensor in load_progress(tensors.items(), len(tensors), "loading weights"):
        target = hf_name(name)
        if target is None:
            raise UnsupportedArchitectureError(f"{path}: tensor {name!r} has no Llama counterpart")
        w = _dequantize(tensor, path, dtype)
        if ".attn_q." in name:
            w = unpermute_qk(w, config.num_heads)
        elif ".attn_k." in name:
            w = unpermute_qk(w, config.num_kv_heads)
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

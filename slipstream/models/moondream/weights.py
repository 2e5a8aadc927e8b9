"""Loading a moondream2 safetensors folder.

Two public namings exist. The current one is the reference's own module tree under `model.`
(`model.vision.blocks.0.attn.qkv.weight`, `model.text.wte`, `model.region.coord_features`), which our
module names follow, so it only loses the prefix. The earlier one (`vision_encoder.encoder.model.
visual...`, `text_model.transformer.h.N.mixer.Wqkv...`, `region_model...`) goes through
REFERENCE_NAMES, the one table of public name -> ours; its Fourier frequency matrices are stored
transposed.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from slipstream.errors import CorruptModelError, ModelNotFoundError
from slipstream.models.moondream.config import MoondreamConfig
from slipstream.models.moondream.model import MoondreamForCausalLM

# Earlier public name prefix -> our module name prefix; "{i}" is a block index. A Linear / LayerNorm
# prefix covers its .weight and .bias.
REFERENCE_NAMES: dict[str, str] = {
    "vision_encoder.encoder.model.visual.patch_embed.linear": "vision.patch_emb",
    "vision_encoder.encoder.model.visual.pos_embed": "vision.pos_emb",
    "vision_encoder.encoder.model.visual.blocks.{i}.norm1": "vision.blocks.{i}.ln1",
    "vision_encoder.encoder.model.visual.blocks.{i}.norm2": "vision.blocks.{i}.ln2",
    "vision_encoder.encoder.model.visual.blocks.{i}.attn.qkv": "vision.blocks.{i}.attn.qkv",
    "vision_encoder.encoder.model.visual.blocks.{i}.attn.proj": "vision.blocks.{i}.attn.proj",
    "vision_encoder.encoder.model.visual.blocks.{i}.mlp.fc1": "vision.blocks.{i}.mlp.fc1",
    "vision_encoder.encoder.model.visual.blocks.{i}.mlp.fc2": "vision.blocks.{i}.mlp.fc2",
    "vision_encoder.encoder.model.visual.norm": "vision.post_ln",
    "vision_encoder.projection.mlp.fc1": "vision.proj_mlp.fc1",
    "vision_encoder.projection.mlp.fc2": "vision.proj_mlp.fc2",
    "text_model.transformer.embd.wte.weight": "text.wte",
    "text_model.transformer.h.{i}.ln": "text.blocks.{i}.ln",
    "text_model.transformer.h.{i}.mixer.Wqkv": "text.blocks.{i}.attn.qkv",
    "text_model.transformer.h.{i}.mixer.out_proj": "text.blocks.{i}.attn.proj",
    "text_model.transformer.h.{i}.mlp.fc1": "text.blocks.{i}.mlp.fc1",
    "text_model.transformer.h.{i}.mlp.fc2": "text.blocks.{i}.mlp.fc2",
    "text_model.lm_head.ln": "text.post_ln",
    "text_model.lm_head.linear": "text.lm_head",
    "region_model.coordinate_features.weight": "region.coord_features",  # stored [F, 1]: transposed
    "region_model.size_features.weight": "region.size_features",  # stored [F, 2]: transposed
    "region_model.coordinate_encoder": "region.coord_encoder",
    "region_model.coordinate_decoder.fc1": "region.coord_decoder.fc1",
    "region_model.coordinate_decoder.fc2": "region.coord_decoder.fc2",
    "region_model.size_encoder": "region.size_encoder",
    "region_model.size_decoder.fc1": "region.size_decoder.fc1",
    "region_model.size_decoder.fc2": "region.size_decoder.fc2",
}
_TRANSPOSED = {"region.coord_features", "region.size_features"}


def _compile_table() -> list[tuple[re.Pattern, str]]:
    out = []
    for public, ours in REFERENCE_NAMES.items():
        pattern = re.escape(public).replace(re.escape("{i}"), r"(\d+)")
        # a prefix entry also matches its .weight / .bias; a full name matches itself
        out.append((re.compile(pattern + r"(\.weight|\.bias)?"), ours.replace("{i}", r"\1")))
    return out


_TABLE = _compile_table()


def _map_reference_name(name: str) -> str | None:
    for pattern, ours in _TABLE:
        m = pattern.fullmatch(name)
        if m:
            suffix = m.group(m.re.groups) or ""  # the last group: the .weight/.bias suffix
            return m.expand(ours) + ("" if ours.endswith((".wte", "_features", ".pos_emb")) else suffix)
    return None


def to_module_names(weights: dict[str, torch.Tensor], source: Path | str = "<weights>") -> dict[str, torch.Tensor]:
    """Public moondream2 tensor names (either naming) -> our module names."""
    weights = {k.replace("._orig_mod", ""): v for k, v in weights.items()}
    if any(k.startswith("vision_encoder.") for k in weights):
        out = {}
        for name, tensor in weights.items():
            ours = _map_reference_name(name)
            if ours is None:
                raise CorruptModelError(f"{source}: unexpected moondream tensor {name!r}")
            out[ours] = tensor.T.contiguous() if ours in _TRANSPOSED else tensor
        return out
    return {k.removeprefix("model."): v for k, v in weights.items()}


def load_moondream_folder(folder: Path | str, dtype: torch.dtype = torch.float32,
                          device: torch.device | str = "cpu") -> MoondreamForCausalLM:
    """A moondream2 folder (config.json whose `config` holds the reference's sections, optional, and
    *.safetensors) -> the model on `device` in `dtype`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{folder}: no *.safetensors files")
    sections: dict[str, Any] = {}
    config_path = folder / "config.json"
    if config_path.is_file():
        try:
            sections = json.loads(config_path.read_text()).get("config", {}) or {}
        except (ValueError, AttributeError) as exc:
            raise CorruptModelError(f"{config_path}: not a JSON object ({exc})") from exc
    config = MoondreamConfig.from_reference_dict(sections, name=folder.name)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    weights = to_module_names(weights, folder)
    try:
        return MoondreamForCausalLM.from_weights(config, weights, dtype, device)
    except RuntimeError as exc:  # load_state_dict: missing / unexpected tensors or wrong shapes
        raise CorruptModelError(f"{folder}: {exc}") from exc

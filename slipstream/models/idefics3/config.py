"""Hyper-parameters of an Idefics3 folder: the vision tower, the connector and the image processor."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from slipstream.errors import CorruptModelError, UnsupportedArchitectureError
from slipstream.models.json_file import read_json_object

ARCHITECTURES = ("Idefics3ForConditionalGeneration",)
MODEL_TYPES = ("idefics3",)

RGB = tuple[float, float, float]  # per-channel image mean / std


@dataclass(frozen=True)
class ProcessingConfig:
    """The image processor's settings (transformers' Idefics3ImageProcessor names)."""
    longest_edge: int = 4 * 364  # size.longest_edge: the whole image is first resized to fit this
    tile: int = 364  # max_image_size.longest_edge: the side of a tile and of the global view
    do_image_splitting: bool = True
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resample: int = 1  # PIL's LANCZOS


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower (SigLIP-style ViT), the connector and the processor settings."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    scale_factor: int
    text_hidden_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    processing: ProcessingConfig = ProcessingConfig()

    def __post_init__(self) -> None:
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.scale_factor:
            raise ValueError(f"image_size={self.image_size} / patch_size={self.patch_size} must be a whole "
                             f"multiple of scale_factor={self.scale_factor}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}")
        if self.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision hidden_act={self.hidden_act!r} is not supported")

    @property
    def tokens_per_tile(self) -> int:
        """`<image>` tokens (connector outputs) per tile: (side/patch)^2 / scale_factor^2."""
        return (self.image_size // self.patch_size) ** 2 // self.scale_factor ** 2


def is_idefics3(cfg: Mapping[str, Any]) -> bool:
    return any(a in ARCHITECTURES for a in cfg.get("architectures") or []) or cfg.get("model_type") in MODEL_TYPES


def is_idefics3_folder(folder: Path) -> bool:
    """Whether the folder's config.json names Idefics3; an unreadable one is left to the Llama loader
    to report."""
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and is_idefics3(cfg)


def text_config_dict(cfg: Mapping[str, Any], source: Path | str) -> dict[str, Any]:
    """The decoder's part of an Idefics3 config.json, as a Llama config dict for hf_loader.config_from_hf."""
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise CorruptModelError(f"{source}: an Idefics3 config needs a text_config object")
    if text.get("model_type", "llama") != "llama":
        raise UnsupportedArchitectureError(f"{source}: Idefics3 with a {text.get('model_type')!r} decoder is not "
                                           f"supported (only llama)")
    out = {k: v for k, v in text.items() if k != "architectures"}
    out["model_type"] = "llama"
    return out


def vision_config_from_hf(cfg: Mapping[str, Any], text_hidden: int, processing: ProcessingConfig,
                          source: Path | str) -> VisionConfig:
    v = cfg.get("vision_config") or {}
    try:
        return VisionConfig(
            hidden_size=int(v.get("hidden_size", 1152)),
            intermediate_size=int(v.get("intermediate_size", 3072)),
            num_layers=int(v.get("num_hidden_layers", 12)),
            num_heads=int(v.get("num_attention_heads", 16)),
            image_size=int(v.get("image_size", 224)),
            patch_size=int(v.get("patch_size", 32)),
            num_channels=int(v.get("num_channels", 3)),
            layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
            hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
            scale_factor=int(cfg.get("scale_factor", 2)),
            text_hidden_size=text_hidden,
            processing=processing,
        )
    except (TypeError, ValueError) as exc:
        raise CorruptModelError(f"{source}: vision_config lacks or mangles a field ({exc})") from exc




def processor_files(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(image processor settings, processor settings): transformers 5 nests the former in
    processor_config.json; transformers 4 folders (the Hub's SmolVLM) keep preprocessor_config.json."""
    proc = read_json_object(folder / "processor_config.json", strict=True)
    image = proc.get("image_processor") if isinstance(proc.get("image_processor"), dict) else None
    return (image if image is not None else read_json_object(folder / "preprocessor_config.json", strict=True)), proc


def processing_config(image: Mapping[str, Any], source: Path | str) -> ProcessingConfig:
    """ProcessingConfig from the image processor's settings; defaults are transformers' class defaults."""
    d = ProcessingConfig()

    def edge(key: str, default: int) -> int:
        value = image.get(key)
        if value is None:
            return default
        if not isinstance(value, Mapping) or "longest_edge" not in value:
            raise CorruptModelError(f"{source}: {key} must be an object with longest_edge, got {value!r}")
        return int(value["longest_edge"])

    try:
        return ProcessingConfig(
            longest_edge=edge("size", d.longest_edge),
            tile=edge("max_image_size", d.tile),
            do_image_splitting=bool(image.get("do_image_splitting", d.do_image_splitting)),
            do_resize=bool(image.get("do_resize", d.do_resize)),
            do_rescale=bool(image.get("do_rescale", d.do_rescale)),
            rescale_factor=float(image.get("rescale_factor", d.rescale_factor)),
            do_normalize=bool(image.get("do_normalize", d.do_normalize)),
            image_mean=cast(RGB, tuple(float(x) for x in image.get("image_mean", d.image_mean))),
            image_std=cast(RGB, tuple(float(x) for x in image.get("image_std", d.image_std))),
            resample=int(image.get("resample", d.resample)),
        )
    except (TypeError, ValueError) as exc:
        raise CorruptModelError(f"{source}: the image processor config lacks or mangles a field ({exc})") from exc

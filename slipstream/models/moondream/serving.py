"""A moondream2 folder served as a vision-language model: detecting the folder, its tokenizer, and
the prompt of the reference's `query` skill (docs/moondream.md, "Serving a moondream2 folder").

The prompt is BOS + one image's placeholder tokens (the bidirectional prefix), then the query
template's prefix ids, the tokens of " " + question, and the template's suffix ids: the reference
tokenises only the question and writes the template as ids.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from slipstream.errors import CorruptModelError, InvalidRequestError
from slipstream.models.moondream.config import MoondreamConfig
from slipstream.models.moondream.image import MoondreamImage, preprocess

if TYPE_CHECKING:
    from PIL import Image

    from slipstream.models.moondream.model import MoondreamForCausalLM
    from slipstream.models.tokenizers.tokenizer import Tokenizer

MODEL_TYPES = ("moondream1", "moondream2")
IMAGE_MARKER = "<image>"  # (api/image_prompt.py's marker; models/ may not import the API layer)


def is_moondream_folder(path: Path) -> bool:
    """config.json names a moondream model (the hub's model_type / HfMoondream), or holds only the
    reference's `config` sections (the folder layout load_moondream_folder reads)."""
    cfg_path = path / "config.json"
    if not path.is_dir() or not cfg_path.is_file():
        return False
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # the generic loader reports the broken file
    if not isinstance(cfg, dict):
        return False
    archs = cfg.get("architectures") or []
    return cfg.get("model_type") in MODEL_TYPES or any("Moondream" in str(a) for a in archs)


def load_moondream_tokenizer(folder: Path, config: MoondreamConfig) -> "Tokenizer":
    """The folder's tokenizer.json with the config's BOS and EOS. The reference downloads its
    tokenizer from the hub; slipstream reads only the folder, so a missing file is refused."""
    from slipstream.models.tokenizers.tokenizer import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CorruptModelError(f"{path}: missing from the moondream folder (the reference fetches its tokenizer "
                                "from the hub; copy moondream2's tokenizer.json into the folder)")
    try:
        text = path.read_text(encoding="utf-8")
        return Tokenizer.from_json(text, bos_token_id=config.text.bos_token_id,
                                   eos_token_ids=config.text.eos_token_ids, chat_template=None)
    except Exception as exc:  # noqa: BLE001 - OSError, or the tokenizers library's own error type
        raise CorruptModelError(f"{path}: not a tokenizer.json ({exc})") from exc


def load_moondream_serving(folder: Path, dtype: torch.dtype, device) -> tuple["MoondreamForCausalLM", "Tokenizer"]:
    from slipstream.models.moondream.weights import load_moondream_folder

    model = load_moondream_folder(folder, dtype=dtype, device=device)
    return model, load_moondream_tokenizer(folder, model.moondream_config)


class MoondreamProcessing:
    """The engine's image processing for Moondream: one image per request, the query prompt."""

    def __init__(self, config: MoondreamConfig):
        self.config = config

    def preprocess(self, images: Sequence["Image.Image"]) -> list[MoondreamImage]:
        return [preprocess(im, self.config.vision) for im in images]

    def largest_input(self) -> MoondreamImage:
        """An image of `max_crops` local crops, the most `preprocess` makes (the engine profiles the
        vision tower's peak on it before sizing the KV pool); its pixels do not matter."""
        v = self.config.vision
        rows = max(r for r in range(1, v.max_crops + 1) if v.max_crops % r == 0 and r * r <= v.max_crops)
        return MoondreamImage(pixel_values=torch.zeros(1 + v.max_crops, v.in_channels, v.crop_size, v.crop_size),
                              tiling=(rows, v.max_crops // rows), num_image_tokens=v.tokens_per_image)

    def prompt_ids(self, prompt: str, processed: Sequence[MoondreamImage], tokenizer: Any) -> list[int]:
        """[BOS, image placeholders..., query prefix, " " + question, query suffix]. The question is
        the prompt without its `<image>` marker (none, or one at its start)."""
        if len(processed) != 1:
            raise InvalidRequestError(f"images: moondream answers about exactly one image per request, got "
                                      f"{len(processed)}", param="images")
        question = prompt
        if IMAGE_MARKER in question:
            if not question.startswith(IMAGE_MARKER) or question.count(IMAGE_MARKER) > 1:
                raise InvalidRequestError(f"prompt: moondream's image comes before the question; write one "
                                          f"{IMAGE_MARKER} marker at the start, or none", param="prompt")
            question = question[len(IMAGE_MARKER):]
        text = self.config.text
        image = [text.image_token_id] * processed[0].num_image_tokens
        c = self.config
        return [text.bos_token_id, *image, *c.query_prefix, *tokenizer.encode(" " + question.strip()),
                *c.query_suffix]

    @property
    def region_tokens(self) -> tuple[int, int]:
        """(coord_id, size_id): the tokens whose next input is a coordinate / a size (point, detect)."""
        return self.config.coord_token_id, self.config.size_token_id

    def region_template(self, kind: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(prefix ids, suffix ids) of the reference's `point` / `detect` prompt; None: not in this folder."""
        return {"point": self.config.point_template, "detect": self.config.detect_template}[kind]

    def skill_prompt_ids(self, kind: str, obj: str, processed: Sequence[MoondreamImage], tokenizer: Any) -> list[int]:
        """[BOS, image placeholders..., the skill's prefix ids, " " + object, its suffix ids]: the
        reference's point/detect prompt (the object name is the only text)."""
        if len(processed) != 1:
            raise InvalidRequestError(f"images: moondream's {kind} looks at exactly one image, got {len(processed)}",
                                      param="images")
        template = self.region_template(kind)
        if template is None:
            raise InvalidRequestError(f"grammar: this moondream folder has no {kind} template "
                                      "(its config.json sets it to null)", param="grammar")
        text = self.config.text
        return [text.bos_token_id, *[text.image_token_id] * processed[0].num_image_tokens, *template[0],
                *tokenizer.encode(" " + obj), *template[1]]

    def bidirectional_len(self, spans: Sequence[Any]) -> int:
        """Positions attending both ways: BOS + the image's placeholders (0 without an image)."""
        return int(spans[0].end) if spans else 0

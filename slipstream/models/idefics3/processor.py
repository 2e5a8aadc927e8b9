"""Idefics3's image preprocessing and prompt expansion, equal to transformers' Idefics3Processor
with its PIL image processor (tests/test_idefics3_model.py checks both against it).

An image is resized so its longest edge is `longest_edge` (the other side kept in proportion and made
even), then enlarged to whole multiples of `tile` and cut into rows x cols tiles, row by row, followed
by a global view (the whole image resized to one tile). An image that fits one tile, or a config
without splitting, gives the global view alone (rows = cols = 0). Pixels are scaled to [0, 1] and
normalised per channel. Every resize is PIL's, on 8-bit RGB, as transformers does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from slipstream.errors import InvalidRequestError
from slipstream.models.idefics3.config import ProcessingConfig, VisionConfig, processing_config, processor_files

IMAGE_TOKEN = "<image>"
FAKE_TOKEN = "<fake_token_around_image>"
GLOBAL_TOKEN = "<global-img>"
SPECIAL_TOKENS = (IMAGE_TOKEN, FAKE_TOKEN, GLOBAL_TOKEN, "<end_of_utterance>")
MAX_SIDE = 4096  # transformers' MAX_IMAGE_SIZE: no resized side exceeds it


@dataclass(frozen=True)
class ProcessedImage:
    pixel_values: torch.Tensor  # [tiles, 3, tile, tile] float32; the global view is last
    pixel_attention_mask: torch.Tensor  # [tiles, tile, tile] bool
    rows: int  # 0, 0: not split (the global view alone)
    cols: int
    num_image_tokens: int  # tiles x tokens per tile: the `<image>` placeholders of this image

    @property
    def num_tiles(self) -> int:
        return int(self.pixel_values.shape[0])


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (as transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def fit_longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest side set to `longest`, the other in proportion, truncated and
    rounded up to even; then scaled down so neither exceeds MAX_SIDE."""
    ratio = width / height
    if width >= height:
        width, height = longest, int(longest / ratio)
        height += height % 2
    else:
        height, width = longest, int(longest * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    ratio = width / height
    if width >= height and width > MAX_SIDE:
        width, height = MAX_SIDE, int(MAX_SIDE / ratio)
    elif height > width and height > MAX_SIDE:
        height, width = MAX_SIDE, int(MAX_SIDE * ratio)
    return max(height, 1), max(width, 1)


def tile_multiple(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) enlarged to whole tiles: the longer side first, the shorter from the ratio."""
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    return height, width


class Idefics3Processing:
    """Turns PIL images into tiles and the prompt's `<image>` markers into placeholder tokens."""

    def __init__(self, config: ProcessingConfig, tokens_per_tile: int):
        self.config = config
        self.tokens_per_tile = tokens_per_tile
        c = config
        self._mean = np.asarray(c.image_mean, dtype=np.float32)[:, None, None]
        self._std = np.asarray(c.image_std, dtype=np.float32)[:, None, None]

    @classmethod
    def for_vision(cls, vision: VisionConfig) -> "Idefics3Processing":
        return cls(vision.processing, vision.tokens_per_tile)

    @classmethod
    def from_folder(cls, folder: str | Path, tokens_per_tile: int) -> "Idefics3Processing":
        image, _ = processor_files(Path(folder))
        return cls(processing_config(image, folder), tokens_per_tile)

    def _resize(self, image: Image.Image, height: int, width: int) -> Image.Image:
        return image.resize((width, height), resample=Image.Resampling(self.config.resample))

    def _tiles(self, image: Image.Image) -> tuple[list[Image.Image], int, int]:
        c = self.config
        if c.do_resize:
            image = self._resize(image, *fit_longest_edge(image.height, image.width, c.longest_edge))
        if not c.do_image_splitting:
            return [self._resize(image, c.tile, c.tile)], 0, 0
        image = self._resize(image, *tile_multiple(image.height, image.width, c.tile))
        if image.height <= c.tile and image.width <= c.tile:
            return [image], 0, 0
        rows, cols = image.height // c.tile, image.width // c.tile
        frames = [image.crop((col * c.tile, row * c.tile, (col + 1) * c.tile, (row + 1) * c.tile))
                  for row in range(rows) for col in range(cols)]
        return frames + [self._resize(image, c.tile, c.tile)], rows, cols

    def _pixels(self, frame: Image.Image) -> np.ndarray:
        x: np.ndarray = np.asarray(frame, dtype=np.uint8).transpose(2, 0, 1)  # CHW
        if self.config.do_rescale:  # in float64, then float32, as transformers' rescale
            x = (x.astype(np.float64) * self.config.rescale_factor).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if self.config.do_normalize:
            x = (x - self._mean) / self._std
        return x

    def preprocess(self, images: list[Image.Image]) -> list[ProcessedImage]:
        out = []
        for image in images:
            frames, rows, cols = self._tiles(to_rgb(image))
            # contiguous: astype and stack keep the HWC memory order of each frame's CHW view, and the
            # encoder launch copies only one contiguous range (runtime/host_copy.stage_pixels)
            pixels = np.ascontiguousarray(np.stack([self._pixels(f) for f in frames]))
            t = self.config.tile
            if pixels.shape[-2:] != (t, t):  # cannot happen: every frame is one tile
                raise AssertionError(f"frame of {pixels.shape[-2:]} pixels, expected {t}x{t}")
            out.append(ProcessedImage(
                pixel_values=torch.from_numpy(pixels),
                pixel_attention_mask=torch.ones(len(frames), t, t, dtype=torch.bool),
                rows=rows, cols=cols, num_image_tokens=len(frames) * self.tokens_per_tile))
        return out

    def largest_input(self) -> ProcessedImage:
        """The image with the most tiles this processing makes (the engine profiles the vision tower's
        peak on it before sizing the KV pool): a square at the longest edge. Without resizing nothing
        bounds a picture's side; MAX_SIDE (transformers' bound on a resized side) is taken."""
        side = self.config.longest_edge if self.config.do_resize else MAX_SIDE
        return self.preprocess([Image.new("RGB", (side, side))])[0]

    def image_text(self, image: ProcessedImage) -> str:
        """What one `<image>` marker becomes: a tagged run of placeholders per tile, a newline after
        each row, then (after one more newline when split) the global view."""
        run = IMAGE_TOKEN * self.tokens_per_tile
        global_view = f"{FAKE_TOKEN}{GLOBAL_TOKEN}{run}{FAKE_TOKEN}"
        if image.rows == 0 and image.cols == 0:
            return global_view
        rows = ["".join(f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>{run}" for c in range(image.cols)) + "\n"
                for r in range(image.rows)]
        return "".join(rows) + "\n" + global_view

    def expand(self, text: str, images: list[ProcessedImage]) -> str:
        """`text` with its i-th `<image>` marker replaced by image i's placeholder text."""
        parts = text.split(IMAGE_TOKEN)
        if len(parts) - 1 != len(images):
            raise InvalidRequestError(f"prompt: {len(parts) - 1} {IMAGE_TOKEN} markers for {len(images)} images")
        pieces = [parts[0]]
        for image, after in zip(images, parts[1:]):
            pieces += [self.image_text(image), after]
        return "".join(pieces)

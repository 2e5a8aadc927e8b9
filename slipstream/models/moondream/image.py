"""Moondream 2's image preprocessing with PIL and numpy: one global crop of the whole image plus a
grid of overlapping local crops, scaled to [-1, 1].

The local crops overlap by `overlap_margin` patches on each side; the grid (rows, cols) is chosen so
each crop's inner window covers a similar share of the image, at most `max_crops` crops. The
public reference resizes with pyvips when it is installed and with PIL's Lanczos otherwise; this is
the PIL form (pixel values may differ by a few levels from a pyvips-equipped reference).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from typing import TYPE_CHECKING

import numpy as np
import torch

from slipstream.models.moondream.config import MoondreamVisionConfig

if TYPE_CHECKING:  # Pillow is imported where an image is cut: a text-only install need not have it
    from PIL import Image


@dataclass(frozen=True)
class MoondreamImage:
    pixel_values: torch.Tensor  # [1 + rows * cols, 3, crop, crop] float32 in [-1, 1]; crop 0 is the global view
    tiling: tuple[int, int]  # (rows, cols) of the local crops
    num_image_tokens: int  # features the vision encoder returns for it (grid², 729)


def select_tiling(height: int, width: int, window: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of local crops whose windows of `window` pixels cover height x width."""
    if height <= window or width <= window:
        return 1, 1
    need_rows, need_cols = math.ceil(height / window), math.ceil(width / window)
    if need_rows * need_cols > max_crops:  # too big: shrink both sides by the same factor
        scale = math.sqrt(max_crops / (need_rows * need_cols))
        return max(1, math.floor(need_rows * scale)), max(1, math.floor(need_cols * scale))
    # the grid of the image's aspect ratio with max_crops cells, but at least the needed counts
    rows = max(math.floor(math.sqrt(max_crops * height / width)), need_rows)
    cols = max(math.floor(math.sqrt(max_crops * width / height)), need_cols)
    if rows * cols > max_crops:  # give back crops along the longer side
        if cols > rows:
            cols = math.floor(max_crops / rows)
        else:
            rows = math.floor(max_crops / cols)
    return max(1, rows), max(1, cols)


def overlap_crops(image: "Image.Image", config: MoondreamVisionConfig) -> tuple[np.ndarray, tuple[int, int]]:
    """uint8 crops [1 + rows * cols, crop, crop, 3] (global first, then row-major) and (rows, cols)."""
    from PIL import Image

    rgb = np.asarray(image.convert("RGB"))
    height, width = rgb.shape[:2]
    crop = config.crop_size
    margin = config.overlap_margin * config.patch_size  # pixels, each side
    window = crop - 2 * margin
    rows, cols = select_tiling(height - 2 * margin, width - 2 * margin, window, config.max_crops)
    crops = np.zeros((1 + rows * cols, crop, crop, 3), dtype=np.uint8)
    pil = Image.fromarray(rgb)
    target_h, target_w = rows * window + 2 * margin, cols * window + 2 * margin
    resized = np.asarray(pil.resize((target_w, target_h), resample=Image.Resampling.LANCZOS))
    crops[0] = np.asarray(pil.resize((crop, crop), resample=Image.Resampling.LANCZOS))
    for r in range(rows):
        for c in range(cols):
            piece = resized[r * window: r * window + crop, c * window: c * window + crop]
            crops[1 + r * cols + c, : piece.shape[0], : piece.shape[1]] = piece
    return crops, (rows, cols)


def preprocess(image: "Image.Image", config: MoondreamVisionConfig) -> MoondreamImage:
    crops, tiling = overlap_crops(image, config)
    pixels = torch.from_numpy(np.ascontiguousarray(crops.transpose(0, 3, 1, 2))).float()
    return MoondreamImage(pixel_values=pixels.div(255.0).sub(0.5).div(0.5), tiling=tiling,
                          num_image_tokens=config.tokens_per_image)

"""Images on the runner side: the vision encoder launched before the forward that first reads its
outputs, and the embeddings an image step's forward takes in place of its placeholder tokens.

`ImageEncodes` is held by the ModelRunner (`runner.images`, model_runner.py), with `features`: encoder
outputs by image digest, kept until the scheduler's EncoderCache drops them. Encodes and forwards both
run on the compute stream, so stream order makes every output exist before a forward reads it. A
text-only step never comes here.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from slipstream.errors import PipelineInvariantError
from slipstream.models.base import Model
from slipstream.runtime.batch import ForwardInput, ImageSpan
from slipstream.runtime.devices.host_copy import stage_pixels, upload_array


class ImageEncodes:
    def __init__(self, model: Model, device: Any):
        self.model, self.device = model, device
        # encoder outputs by image digest; which are kept is the scheduler's EncoderCache's decision.
        # Written by encode launches and read by forwards, both on the compute stream (stream order)
        self.features: dict[bytes, torch.Tensor] = {}

    def launch(self, images: Sequence[ImageSpan]) -> None:
        """Enqueue the vision encoder on these images, on the compute stream (so every later forward
        finds their outputs); returns at once. Pixels go up from pinned memory (no host wait)."""
        if self.model.vision is None:
            raise PipelineInvariantError("images launched on a model without a vision tower")
        # the model encodes its own preprocessed image (Moondream's needs its crop tiling too), given
        # its pixels on the device
        encode_image = self.model.encode_image
        dev, features = self.device.torch_device, self.features
        items = list(images)

        def encode() -> None:
            for span in items:
                p = span.processed
                pixels = stage_pixels(p.pixel_values, dev)  # (pinned off the loop: host_copy.pin_pixels)
                mask = getattr(p, "pixel_attention_mask", None)  # (Idefics3's tiles; Moondream has none)
                mask = None if mask is None else np.asarray(mask)
                # no padding (Idefics3's tiles never have any), known here on the host: no mask,
                # so attention runs without a bias
                mask = upload_array(mask, dev) if mask is not None and not mask.all() else None
                out = encode_image(dataclasses.replace(p, pixel_values=pixels), mask)
                if out.shape[0] != span.num_features:
                    raise PipelineInvariantError(f"the encoder gave {out.shape[0]} rows for an image of "
                                                 f"{span.num_features} placeholders")
                features[span.digest] = out

        self.device.compute.launch(encode, "encode")

    def drop(self, digests: Sequence[bytes]) -> None:
        for digest in digests:
            self.features.pop(digest, None)

    def embeds(self, packed: ForwardInput, num_decode: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(embed_rows, embeds) of a step with image rows, gathered on the compute stream when its
        forward runs (the encodes before it have run by then); None for a text-only step."""
        if not packed.has_embeds:
            return None
        dev = self.device.torch_device
        rows = upload_array(packed.embed_rows + num_decode, dev)
        parts = [self.features[digest][upload_array(index, dev)] for digest, index in packed.embed_sources]
        return rows, torch.cat(parts)

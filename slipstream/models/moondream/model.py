"""Moondream 2 as one module: the vision encoder, the text decoder and the region heads.

`forward(batch, kv) -> logits` is the runtime's contract (the Llama family's); `forward_hidden`
adds the sampled rows' last hidden state for the region heads. `config` is the text section (it has
ModelConfig's field names, which the runtime reads); `moondream_config` is the whole layout.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from slipstream.models.carry_heads import apply_carry
from slipstream.models.moondream.carry import RegionCarryHeads
from slipstream.models.moondream.config import MoondreamConfig
from slipstream.models.moondream.image import MoondreamImage, preprocess
from slipstream.models.moondream.region import RegionHeads
from slipstream.models.moondream.text import MoondreamText
from slipstream.models.moondream.vision import VisionEncoder

if TYPE_CHECKING:
    from PIL import Image

    from slipstream.models.base import ForwardBatch, KVCache


class MoondreamForCausalLM(nn.Module):
    def __init__(self, config: MoondreamConfig):
        super().__init__()
        self.moondream_config = config
        self.config = config.text
        self.vision = VisionEncoder(config.vision)
        self.text = MoondreamText(config.text)
        self.region = RegionHeads(config.region, config.text.hidden_size)
        # point/detect feed region values back as inputs (docs/moondream.md, "The carry")
        self.carry_heads = RegionCarryHeads(self.region)
        self.backend = "reference"

    @classmethod
    def from_weights(cls, config: MoondreamConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                     device) -> "MoondreamForCausalLM":
        """From a state dict in our module names (weights.to_module_names maps the public ones)."""
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(weights, strict=True, assign=True)
        # the rotary tables were built on the CPU (not meta): .to() moves them with the weights
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    backends = ("reference", "triton")  # (the compiled CPU kernels are the Llama layout's)

    def set_attention_dtype(self, dtype: torch.dtype | None) -> None:
        block: Any
        for block in self.text.blocks:
            block.attn.compute_dtype = dtype

    def set_kernel_backend(self, backend: str, options=None) -> None:
        """"triton" swaps in the paged attention kernel (text.py); `options` (the Llama family's
        TritonOptions) do not apply to this model and are ignored."""
        if backend not in ("reference", "triton"):
            raise ValueError(f"kernel backend must be 'reference' or 'triton', got {backend!r}")
        self.backend = backend
        block: Any
        for block in self.text.blocks:
            block.attn.backend = backend

    def set_activations(self, mode: str) -> None:
        """Nothing to set: this model has no "cpu" backend (the compiled CPU kernels are the Llama layout's)."""

    def forward_hidden(self, batch: "ForwardBatch", kv: "KVCache") -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 logits [N, vocab], hidden [N, hidden] in the model dtype) for batch.sample_indices;
        the hidden state is the one the region heads decode (before the final LayerNorm). Rows of
        `batch.carry` with a kind > 0 take the region encoding of their value as input."""
        x = self.text.embed(batch)
        carry = getattr(batch, "carry", None)
        if carry is not None:
            x = apply_carry(self.carry_heads, x, carry)
        hidden = self.text.blocks_forward(x, batch, kv).index_select(0, batch.sample_indices)
        return self.text.logits(hidden), hidden

    def forward(self, batch: "ForwardBatch", kv: "KVCache"):
        """float32 logits of batch.sample_indices; with `batch.return_hidden`, (logits, hidden)."""
        logits, hidden = self.forward_hidden(batch, kv)
        return (logits, hidden) if getattr(batch, "return_hidden", False) else logits

    def preprocess(self, image: "Image.Image") -> MoondreamImage:
        return preprocess(image, self.moondream_config.vision)

    def encode_image(self, image: MoondreamImage, mask: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens_per_image, hidden] embeddings for the image positions of a prompt (its crops are
        never padded: `mask` is always None)."""
        return self.vision.encode(image.pixel_values, image.tiling)

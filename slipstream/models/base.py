"""What a model is to the rest of slipstream: the `Model` protocol, the `ForwardBatch` one forward
takes and the paged `KVCache` it reads and writes.

The runtime (runtime/model_runner.py and its parts) and the API's assembly (api/assemble.py) ask a
model only what `Model` names; a family (models/llama, models/idefics3, models/moondream) implements
it and is built through models/registry.py by its family name. Nothing here imports a family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from slipstream.models.carry_heads import CarryHeads, CarryInput
from slipstream.models.config import ModelConfig
from slipstream.models.kernels.attention import AttentionMetadata
from slipstream.models.lora import LoraInput

# EngineConfig.dtype names -> torch dtypes (weights, activations, KV cache)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64; T may include trailing padding tokens
    positions: torch.Tensor  # [T] int64
    kv_indices: torch.Tensor  # [T] int64, the KV index each token writes (padding -> scratch page)
    sample_indices: torch.Tensor  # [N] int64, token rows whose logits are returned
    attn: AttentionMetadata
    # Images: after the token embedding, rows embed_rows ([K] int64) take embeds ([K, hidden], the
    # vision tower's output for those placeholder tokens). None for text-only steps.
    embed_rows: torch.Tensor | None = None
    embeds: torch.Tensor | None = None
    # The carry (models/carry_heads.py): rows whose kind is > 0 take their head value's encoding;
    # return_hidden: the forward returns (logits, hidden of the sample rows). Off for steps without
    # a carry row.
    carry: CarryInput | None = None
    return_hidden: bool = False
    # LoRA (models/lora.py): each token's adapter slot and the adapters; None: no adapter is loaded
    lora: LoraInput | None = None


class KVCache:
    """Per-layer key/value pools of shape [num_pages * page_size, kv_heads, head_dim]: the KV layout
    of a model is its config's num_layers x num_kv_heads x head_dim."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device):
        shape = (config.num_layers, num_pages * page_size, config.num_kv_heads, config.head_dim)
        # Uninitialised: attention reads only KV indices a forward has written (kv_len), so nothing needs
        # zeros; and on the CPU untouched pages of a large pool stay out of resident memory (the
        # page pool hands out low pages first and reuses freed ones, so the touched part stays small).
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.num_pages, self.page_size = num_pages, page_size

    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class Model(Protocol):
    """What the runtime and the API may ask of a model; nothing else (no getattr probing)."""

    # vocab_size, max_position_embeddings, hidden_size (an encoder output row's width) and the KV
    # layout (num_layers x num_kv_heads x head_dim), in ModelConfig's field names
    config: ModelConfig
    backend: str  # the kernel backend it runs on now: "reference" (host attention), "triton", "cpu"
    carry_heads: CarryHeads | None  # heads whose values a row feeds back as its next input; None: none
    vision: torch.nn.Module | None  # its image encoder (None: text only); images go through encode_image

    @property
    def backends(self) -> tuple[str, ...]:
        """The kernel backends it can run on."""
        ...

    def __call__(self, batch: ForwardBatch, kv: KVCache) -> Any:
        """float32 logits [N, vocab] of batch.sample_indices; with batch.return_hidden, (logits, hidden)."""
        ...

    def encode_image(self, image: Any, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One preprocessed image (its pixels on the device) -> its placeholder rows' embeddings
        [num_features, hidden]; `mask`: the pixels that are not padding (None: all are)."""
        ...

    def set_kernel_backend(self, backend: str, options: Any = None) -> None: ...

    def set_activations(self, mode: str) -> None:
        """How quantized matrices multiply on the "cpu" backend (EngineConfig.activations)."""
        ...

    def set_attention_dtype(self, dtype: torch.dtype | None) -> None: ...


def reads_device_attention(model: Model) -> bool:
    """Whether its forward reads attention metadata on the device (what a captured graph can hold),
    rather than the reference backend's per-sequence host metadata."""
    return model.backend == "triton"


@dataclass(frozen=True)
class BuildOptions:
    """How to build a model (EngineConfig's model fields): `pack` runs a float32 CPU model's
    projections through oneDNN; `weights="quantized"` keeps a GGUF's matrices quantized
    (`invariant`: batch-invariant CPU products)."""

    dtype: str = "float32"  # a DTYPES name
    device: torch.device = torch.device("cpu")
    seed: int = 0  # random weights' seed
    pack: bool = False
    weights: str = "dequantized"
    invariant: bool = False


@dataclass(frozen=True)
class ModelFamily:
    """A model family as models/registry.py knows it: how to recognise and build one, and what turns a
    request's images into prompt rows for it."""

    name: str  # the registry key
    # (spec, options) -> (model, tokenizer, config); logs `model_ready`
    build: Callable[[str, BuildOptions], tuple[Model, Any, Any]]
    claims: Callable[[str], bool]  # whether a model spec names a checkpoint of this family
    # the model's image preprocessing and prompt expansion (images.py's ImageProcessing); None: text only
    image_processing: Callable[[Model], Any] = lambda model: None
    lora: bool = False  # its models compute LoRA adapters' deltas (models/lora.py: ForwardBatch.lora)

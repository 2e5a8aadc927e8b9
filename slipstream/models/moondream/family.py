"""Moondream 2 in the registry (models/registry.py): a local moondream2 folder (moondream/serving.py),
built as MoondreamForCausalLM, never packed (the Llama CPU fast path does not apply to its layout)."""
from __future__ import annotations

import time
from pathlib import Path

import structlog

from slipstream.models.base import DTYPES, BuildOptions, Model, ModelFamily

log = structlog.get_logger(__name__)


def _claims(spec: str) -> bool:
    from slipstream.models.config import RANDOM_CONFIGS
    from slipstream.models.moondream.serving import is_moondream_folder

    return spec not in RANDOM_CONFIGS and is_moondream_folder(Path(spec).expanduser())


def _build(spec: str, options: BuildOptions):
    from slipstream.models.moondream.serving import load_moondream_serving

    t0 = time.perf_counter()
    model, tokenizer = load_moondream_serving(Path(spec).expanduser(), DTYPES[options.dtype], options.device)
    log.info("model_ready", model=spec, layers=model.config.num_layers, vocab=model.config.vocab_size,
             dtype=options.dtype, device=str(options.device), architecture="moondream",
             seconds=round(time.perf_counter() - t0, 2))
    return model, tokenizer, model.config


def _image_processing(model: Model):
    from slipstream.models.moondream.model import MoondreamForCausalLM
    from slipstream.models.moondream.serving import MoondreamProcessing

    assert isinstance(model, MoondreamForCausalLM)  # (its own family built it)
    return MoondreamProcessing(model.moondream_config)


MOONDREAM = ModelFamily(name="moondream", build=_build, claims=_claims, image_processing=_image_processing)

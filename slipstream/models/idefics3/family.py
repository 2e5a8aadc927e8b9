"""Idefics3 (SmolVLM) in the registry (models/registry.py): an HF folder whose config.json names it.
Its decoder is the Llama family's, loaded by the same loader (models/loading/loader.py), with the
vision tower as the model's `vision`; its image processing expands each image into tiles' rows."""
from __future__ import annotations

from slipstream.models.base import BuildOptions, Model, ModelFamily


def _claims(spec: str) -> bool:
    from slipstream.errors import ModelNotFoundError
    from slipstream.models.idefics3.config import is_idefics3_folder
    from slipstream.models.loading.loader import resolve_model_path

    try:
        path = resolve_model_path(spec)
    except ModelNotFoundError:
        return False  # (the Llama family reports it)
    return path.is_dir() and is_idefics3_folder(path)


def _build(spec: str, options: BuildOptions):
    from slipstream.models.llama.build import build_llama

    return build_llama(spec, options)


def _image_processing(model: Model):
    from slipstream.models.idefics3.processor import Idefics3Processing

    assert model.config.vision is not None, "an Idefics3 folder built without its vision config"
    return Idefics3Processing.for_vision(model.config.vision)


IDEFICS3 = ModelFamily(name="idefics3", build=_build, claims=_claims, image_processing=_image_processing)

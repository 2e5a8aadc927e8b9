"""The Llama family in the registry (models/registry.py): Llama and Qwen2 checkpoints (GGUF files,
HF folders, known names, hub ids) and the random-weight test models; the fallback for every spec."""
from __future__ import annotations

from slipstream.models.base import BuildOptions, ModelFamily


def _build(spec: str, options: BuildOptions):
    from slipstream.models.llama.build import build_llama

    return build_llama(spec, options)


LLAMA = ModelFamily(name="llama", build=_build, claims=lambda spec: True, lora=True)

"""The model families slipstream builds, by family name: what `build_model` (models/loading/build.py)
and the API's assembly ask, instead of testing a model's type or a config's fields.

A family is one `ModelFamily` (models/base.py) in its own room; adding one means writing it and
calling `register` (tests/test_model_registry.py registers a tiny one from the test). A spec goes to
the most recently registered family that claims it; Llama, the first, claims every spec (known
names, GGUF files, Llama/Qwen2 folders, hub ids, random weights), so it is the fallback.
"""
from __future__ import annotations

from slipstream.models.base import ModelFamily
from slipstream.models.idefics3.family import IDEFICS3
from slipstream.models.llama.family import LLAMA
from slipstream.models.moondream.family import MOONDREAM

_FAMILIES: dict[str, ModelFamily] = {}


def register(arch: ModelFamily) -> ModelFamily:
    if arch.name in _FAMILIES:
        raise ValueError(f"a model family named {arch.name!r} is registered already")
    _FAMILIES[arch.name] = arch
    return arch


def unregister(name: str) -> None:
    _FAMILIES.pop(name)


def get(name: str) -> ModelFamily:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise KeyError(f"no model family {name!r}; registered: {', '.join(_FAMILIES)}") from None


def names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def for_spec(spec: str) -> ModelFamily:
    """The family that builds `spec`: the newest registered one that claims it."""
    for arch in reversed(_FAMILIES.values()):
        if arch.claims(spec):
            return arch
    raise KeyError(f"no registered model family claims {spec!r}")  # (unreachable while Llama is registered)


for _arch in (LLAMA, IDEFICS3, MOONDREAM):
    register(_arch)

"""Which factory builds each drafter (runtime/drafter.py): the built-in "ngram", in-process
registrations (`register_drafter`), then the `slipstream.drafters` entry-point group, the way
grammars plug in (docs/grammars.md). A factory is called as
`factory(history=TokenHistory, max_drafts=int, **options)` and returns a Drafter."""
from __future__ import annotations

import importlib.metadata
import threading
from typing import Any, Callable

from slipstream.runtime.drafter import Drafter

ENTRY_POINT_GROUP = "slipstream.drafters"
BUILTIN = ("ngram",)

Factory = Callable[..., Drafter]
_registered: dict[str, Factory] = {}
_lock = threading.Lock()


def register_drafter(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Register a drafter factory in this process (same contract as an entry point)."""
    if not isinstance(name, str) or not name:
        raise ValueError("a drafter name must be a non-empty string")
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in drafter and cannot be replaced")
    if not callable(factory):
        raise TypeError(f"the factory for {name!r} is not callable")
    with _lock:
        if name in _registered and not replace:
            raise ValueError(f"a drafter named {name!r} is already registered (pass replace=True)")
        _registered[name] = factory


def _factory(name: str) -> Factory:
    if name == "ngram":
        from slipstream.runtime.ngram_drafter import NgramDrafter

        return NgramDrafter
    with _lock:
        if name in _registered:
            return _registered[name]
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()
    known = sorted(set(BUILTIN) | set(_registered))
    raise ValueError(f"unknown drafter {name!r} (known: {', '.join(known)}; or a {ENTRY_POINT_GROUP} entry point)")


def build_drafter(name: str, **options: Any) -> Drafter:
    """The drafter `name`, built with the runner's `history`, `max_drafts` and the user's options."""
    return _factory(name)(**options)

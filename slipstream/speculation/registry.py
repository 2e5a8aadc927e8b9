"""Which factory builds each drafter (speculation/drafter.py): the built-ins "ngram" and "draft", in-process
registrations (`register_drafter`), then the `slipstream.drafters` entry-point group, the way
grammars plug in (docs/grammars.md). A factory is called as
`factory(history=TokenHistory, max_drafts=int, **options)` and returns a Drafter."""
from __future__ import annotations

from typing import Any, Callable

from slipstream.plugins import Plugins
from slipstream.speculation.drafter import Drafter

ENTRY_POINT_GROUP = "slipstream.drafters"
BUILTIN = ("ngram", "draft")

Factory = Callable[..., Drafter]
_plugins: Plugins[Factory] = Plugins("drafter", ENTRY_POINT_GROUP, BUILTIN)


def register_drafter(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Register a drafter factory in this process (same contract as an entry point)."""
    _plugins.register(name, factory, replace=replace)


def _factory(name: str) -> Factory:
    if name == "ngram":
        from slipstream.speculation.ngram_drafter import NgramDrafter

        return NgramDrafter
    if name == "draft":
        from slipstream.speculation.draft_model_drafter import DraftModelDrafter

        return DraftModelDrafter
    factory = _plugins.find(name)  # (a broken entry point raises PluginLoadError, naming it)
    if factory is None:
        raise ValueError(f"unknown drafter {name!r} (known: {', '.join(_plugins.names())}; "
                         f"or a {ENTRY_POINT_GROUP} entry point)")
    return factory


def build_drafter(name: str, **options: Any) -> Drafter:
    """The drafter `name`, built with the runner's `history`, `max_drafts` and the user's options."""
    return _factory(name)(**options)

"""Which factory builds each grammar kind: built-ins, in-process registrations, then entry points.

A factory is any callable `(spec, tokenizer, vocab_size) -> Grammar`. Third-party packages declare
theirs in the `slipstream.grammars` entry-point group (see docs/grammars.md); the entry point's name
is the `GrammarSpec.kind` it serves. Built-in names cannot be taken over.

Plugin grammars are wrapped so that whatever a plugin raises (at compile time, in `matcher()`,
`fill_bitmask`, `accept`, `rollback`) becomes a GrammarError naming the plugin, and so that mask bits
past the tokenizer's vocabulary (logits padding) are cleared whatever the plugin wrote.
"""
from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from slipstream.errors import GrammarCompileError, GrammarError, GrammarMatchError
from slipstream.grammar.base import Grammar, GrammarSpec, IndexMaskMatcher, Matcher, carry_tokens, masks_by_output_index
from slipstream.grammar.bitmask import clear_from
from slipstream.plugins import PluginLoadError, Plugins

ENTRY_POINT_GROUP = "slipstream.grammars"

Factory = Callable[[GrammarSpec, Any, int], Grammar]

BUILTIN_KINDS = ("json_schema", "regex", "choice", "tool_calls", "point", "detect", "segment")

_plugins: Plugins[Factory] = Plugins("grammar", ENTRY_POINT_GROUP, BUILTIN_KINDS)


def _builtin(kind: str) -> Factory | None:
    if kind in ("json_schema", "regex", "choice", "tool_calls"):
        from slipstream.grammar.llguidance_backend import build_llguidance

        return build_llguidance
    if kind in ("point", "detect", "segment"):
        from slipstream.grammar.skills import build_skill

        return build_skill
    return None


def register_grammar(name: str, factory: Factory, *, replace: bool = False) -> None:
    """Register a plugin factory in this process (tests, embedding); same contract as an entry point."""
    _plugins.register(name, factory, replace=replace)


def unregister_grammar(name: str) -> None:
    """Forget an in-process registration (and any cached entry-point load) of `name`."""
    _plugins.unregister(name)


def entry_points() -> list[importlib.metadata.EntryPoint]:
    """The installed `slipstream.grammars` entry points (read fresh each call)."""
    return _plugins.entry_points()


def available_kinds() -> list[str]:
    """Built-in kinds, then registered and installed plugin names."""
    return _plugins.names()


def plugin_factory(name: str) -> Factory:
    """The factory of plugin `name`: registered in-process, or loaded from its entry point."""
    try:
        factory = _plugins.find(name)
    except PluginLoadError as e:
        raise GrammarCompileError(str(e)) from e.__cause__
    if factory is None:
        raise GrammarCompileError(f"unknown grammar kind {name!r} (available: {', '.join(available_kinds())})")
    return factory


def build_grammar(spec: GrammarSpec, tokenizer: Any, vocab_size: int) -> Grammar:
    """Build `spec` with the factory of its kind; plugin grammars come back wrapped (PluginGrammar)."""
    factory = _builtin(spec.kind)
    if factory is not None:
        return factory(spec, tokenizer, vocab_size)
    name = spec.kind
    factory = plugin_factory(name)
    try:
        grammar = factory(spec, tokenizer, vocab_size)
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - a plugin may raise anything; only its request fails
        raise GrammarCompileError(_plugin_message(name, e)) from e
    if not callable(getattr(grammar, "matcher", None)):
        raise GrammarCompileError(f"grammar plugin {name!r} returned {type(grammar).__name__}, not a Grammar")
    limit = min(vocab_size, int(getattr(tokenizer, "vocab_size", vocab_size)))
    try:
        carry = carry_tokens(grammar, f"grammar plugin {name!r}")
    except GrammarError:
        raise
    except Exception as e:  # noqa: BLE001 - a property of the plugin's may raise anything
        raise GrammarCompileError(_plugin_message(name, e) + " (in carry_tokens)") from e
    outside = [t for t in carry if t >= limit]
    if outside:
        raise GrammarCompileError(f"grammar plugin {name!r}: carry tokens {outside} lie outside the vocabulary")
    return PluginGrammar(name, grammar, limit, carry)


def _plugin_message(name: str, e: BaseException) -> str:
    return f"grammar plugin {name!r} raised {type(e).__name__}: {e}"


class PluginGrammar:
    """A plugin's grammar behind the error-wrapping, padding-clearing adapter."""

    def __init__(self, name: str, inner: Grammar, limit: int, carry: dict | None = None) -> None:
        self.name = name
        self.inner = inner
        self.limit = limit  # ids from here on (logits padding) are never allowed
        self.carry_tokens = carry or {}  # read once and checked at build (base.carry_tokens)

    def matcher(self) -> PluginMatcher:
        try:
            m = self.inner.matcher()
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001
            raise GrammarMatchError(_plugin_message(self.name, e)) from e
        return PluginMatcher(self, m)


class PluginMatcher:
    def __init__(self, grammar: PluginGrammar, inner: Matcher) -> None:
        self._g = grammar
        self.inner = inner
        self.depends_on_previous_token = bool(getattr(inner, "depends_on_previous_token", True))
        self.mask_by_output_index = masks_by_output_index(inner)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except (GrammarError, NotImplementedError):
            raise
        except Exception as e:  # noqa: BLE001
            raise GrammarMatchError(f"{_plugin_message(self._g.name, e)} (in {what})") from e

    def fill_bitmask(self, row: np.ndarray) -> None:
        self._call("fill_bitmask", self.inner.fill_bitmask, row)
        clear_from(row, self._g.limit)

    def mask_for_output_index(self, index: int, row: np.ndarray) -> None:
        # (called only when the plugin's matcher has it: masks_by_output_index)
        self._call("mask_for_output_index", cast(IndexMaskMatcher, self.inner).mask_for_output_index, index, row)
        clear_from(row, self._g.limit)

    def accept(self, token: int) -> None:
        self._call("accept", self.inner.accept, token)

    def is_terminated(self) -> bool:
        return bool(self._call("is_terminated", self.inner.is_terminated))

    def rollback(self, n: int) -> None:
        fn = getattr(self.inner, "rollback", None)
        if fn is None:
            raise NotImplementedError(f"grammar plugin {self._g.name!r} does not support rollback")
        self._call("rollback", fn, n)

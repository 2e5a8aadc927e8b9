"""Constrained decoding: grammar specs, compiled grammars, per-sequence matchers, packed bitmasks.

See docs/grammars.md. Built-in kinds: json_schema, regex, choice, tool_calls (llguidance) and the spatial skills
point, detect, segment; plugins register under the `slipstream.grammars` entry-point group.

Names are imported lazily, so `from slipstream.grammar.base import GrammarSpec` (done by
slipstream.params) pulls in neither torch nor llguidance.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GrammarCompileError": "slipstream.errors",
    "GrammarError": "slipstream.errors",
    "GrammarMatchError": "slipstream.errors",
    "GrammarTimeoutError": "slipstream.errors",
    "CarryKind": "slipstream.models.carry_kind",
    "Grammar": "slipstream.grammar.base",
    "GrammarCompiler": "slipstream.grammar.compiler",
    "GrammarSpec": "slipstream.grammar.base",
    "Matcher": "slipstream.grammar.base",
    "allocate_bitmask": "slipstream.grammar.bitmask",
    "allowed_ids": "slipstream.grammar.bitmask",
    "bitmask_to_bool": "slipstream.grammar.bitmask",
    "set_allowed": "slipstream.grammar.bitmask",
    "words_for": "slipstream.grammar.bitmask",
    "BUILTIN_KINDS": "slipstream.grammar.registry",
    "ENTRY_POINT_GROUP": "slipstream.grammar.registry",
    "available_kinds": "slipstream.grammar.registry",
    "register_grammar": "slipstream.grammar.registry",
    "unregister_grammar": "slipstream.grammar.registry",
    "SKILL_KINDS": "slipstream.grammar.skills",
    "parse_skill_output": "slipstream.grammar.skills",
    "TokenTable": "slipstream.grammar.vocab",
    "token_table": "slipstream.grammar.vocab",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.grammar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

"""Tool-call grammars: every call a model writes parses and matches its function's JSON schema.

A `ToolSyntax` is how a model family writes calls: the text before the first call, between two
calls and after the last, and the key its call objects hold the arguments under. Each call is
`{"name": "<function>", "<args_key>": <arguments>}` with the arguments valid against the function's
`parameters` schema. `tool_call_source` turns a request's tools into an llguidance Lark grammar
(docs/grammars.md, "Tool calls"):

- `required`: the output is calls and nothing else (one call unless `parallel`).
- `auto`: free text, with the grammar switched on when the text reaches the syntax's trigger: a
  lazy lexeme (llguidance's "Tool calling" pattern), so the text before it is unconstrained and
  what follows it is calls. A syntax whose calls can only open the output (`at_start`, e.g.
  Llama 3's bare JSON) gets text that does not begin with the trigger, or calls.

The arguments are a `%json` sub-grammar of the parameters schema as given (its `$ref`s resolve
against its own root); the call's frame is literal text, so the name always comes first.
"""
from __future__ import annotations

import functools
import json
import re

import msgspec

from slipstream.errors import GrammarCompileError

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
MODES = ("auto", "required")
# the same fixed layout as json_schema grammars (llguidance_backend.JSON_DEFAULTS): no free whitespace
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_TEXT = "/(.|\\n)*/"


class ToolSyntax(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a model family writes its calls (slipstream/tool_calls/formats.py names the families)."""

    trigger: str  # the text that starts the calls in `auto` mode
    open: str  # before the first call (starts with `trigger` unless `at_start`)
    between: str  # between two calls
    close: str  # after the last call
    args_key: str = "arguments"
    at_start: bool = False  # calls can only open the output (no text before them)

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the grammar writes it (`arguments`: JSON text in the fixed layout)."""
        return f'{{"name": {json.dumps(name)}, "{self.args_key}": {arguments}}}'

    def calls_text(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments JSON) as the grammar writes them: open, calls, close."""
        return self.open + self.between.join(self.call_text(n, a) for n, a in calls) + self.close


class ToolGrammar(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A `tool_calls` GrammarSpec's value (as JSON text, so the compile cache keys on it)."""

    syntax: ToolSyntax
    tools: list[tuple[str, str]]  # (name, parameters schema as JSON text)
    mode: str = "auto"  # "auto" | "required"
    parallel: bool = True  # more than one call
    content: str | None = None  # auto: a JSON schema the text answer must follow (response_format)


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(ToolGrammar).decode


def tool_grammar_value(g: ToolGrammar) -> str:
    return _encode(g).decode()


def arguments_layout(arguments: dict | list) -> str:
    """Arguments as JSON text in the grammar's layout (what a model's history calls are written as)."""
    return json.dumps(arguments, ensure_ascii=False, separators=(", ", ": "))


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal (ASCII escapes: the frames are ASCII)


def _json(schema_text: str) -> str:
    schema = json.loads(schema_text)
    return "%json " + json.dumps({**schema, "x-guidance": _LAYOUT})


def tool_call_source(value: str) -> str:
    """The Lark grammar text for a `tool_calls` spec value."""
    try:
        g = _decode(value)
        if g.mode not in MODES:
            raise GrammarCompileError(f"tool_calls grammar: mode must be one of {MODES}, got {g.mode!r}")
        if not g.tools:
            raise GrammarCompileError("tool_calls grammar: no tools")
        s = g.syntax
        lines = ["%llguidance {}"]
        for i, (name, params) in enumerate(g.tools):
            if not TOOL_NAME.fullmatch(name):
                raise GrammarCompileError(f"tool_calls grammar: invalid function name {name!r}")
            frame = _literal(f'{{"name": "{name}", "{s.args_key}": ')
            lines += [f"call_{i}: {frame} args_{i} \"}}\"", f"args_{i}: {_json(params)}"]
        lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(g.tools))))
        more = f"({_literal(s.between)} call)*" if g.parallel else ""
        rest = f"call {more} {_literal(s.close) if s.close else ''}"
        lines.append(f"calls: {_literal(s.open) if s.open else ''} {rest}")
        if g.mode == "required":
            lines.append("start: calls")
        elif g.content is not None or s.at_start:  # calls open the output, or it is the answer
            lines.append("start: answer | calls")
            if g.content is not None:
                lines.append(f"answer: {_json(g.content)}")
            else:
                if len(s.trigger) != 1:
                    raise GrammarCompileError("tool_calls grammar: an at_start trigger must be one character")
                lines += ["answer: NOT_CALLS", f"NOT_CALLS: /([^{re.escape(s.trigger)}](.|\\n)*)?/"]
        else:
            if not s.open.startswith(s.trigger):
                raise GrammarCompileError("tool_calls grammar: the syntax's open text must start with its trigger")
            tail = s.open[len(s.trigger):]
            lines += ["start: answer | head " + (_literal(tail) if tail else "") + f" {rest}",
                      "answer: TEXT", f"TEXT: {_TEXT}", f"head[lazy]: TEXT {_literal(s.trigger)}"]
        return "\n".join(lines) + "\n"
    except (msgspec.DecodeError, ValueError) as e:
        raise GrammarCompileError(f"tool_calls grammar: invalid value ({e})") from None


@functools.lru_cache(maxsize=1024)
def parameters_error(schema_text: str) -> str | None:
    """Why llguidance refuses a function's parameters schema (JSON text), or None. No tokenizer is
    needed; cached, so a request repeating known tools pays a dict lookup."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema_text)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError) as e:
        return str(e)
    return error or None

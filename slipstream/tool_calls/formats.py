"""Which tool-call format a model writes, read from its chat template, and the prompt showing its tools.

The families (docs/tools.md has the table): `hermes` (the template renders `tools` and writes
`<tool_call>`: Qwen2.5, Hermes), `llama3_json` (a Llama 3 template that renders `tools`: bare
`{"name": …, "parameters": {…}}` opening the answer, one call), `smollm2` (SmolLM2's template, which
has no tool section: `<tool_call>[{…}, …]</tool_call>`) and `generic` (anything else: as hermes).
The first two render the tools, the calls and the results through the template itself.

Where slipstream writes the prompt (`smollm2`, `generic`), the tools go into the system message
(appended to the conversation's own, or a new first one), an assistant message's calls are written
as the model writes them (so the history looks like its own output) and a tool result becomes a
user message `<tool_response>\n…\n</tool_response>` (consecutive results share one).
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

from slipstream.errors import InvalidRequestError
from slipstream.grammar.tool_calls import ToolSyntax, arguments_layout
from slipstream.tool_calls.spec import Tool

HERMES = ToolSyntax(trigger="<tool_call>", open="<tool_call>\n", between="\n</tool_call>\n<tool_call>\n",
                    close="\n</tool_call>")
SMOLLM2 = ToolSyntax(trigger="<tool_call>", open="<tool_call>[", between=", ", close="]</tool_call>")
LLAMA3_JSON = ToolSyntax(trigger="{", open="", between="; ", close="", args_key="parameters", at_start=True)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    syntax: ToolSyntax
    native: bool  # the chat template renders the tools, the calls and the results itself
    parallel: bool = True  # the format has room for several calls in one answer


FORMATS = {
    "hermes": ToolFormat("hermes", HERMES, native=True),
    "llama3_json": ToolFormat("llama3_json", LLAMA3_JSON, native=True, parallel=False),
    "smollm2": ToolFormat("smollm2", SMOLLM2, native=False),
    "generic": ToolFormat("generic", HERMES, native=False),
}
_chosen: weakref.WeakKeyDictionary[Any, ToolFormat] = weakref.WeakKeyDictionary()


def format_of_template(template: str | None) -> ToolFormat:
    t = template or ""
    if "tools" in t and "<tool_call>" in t:
        return FORMATS["hermes"]
    if "tools" in t and "<|start_header_id|>" in t:
        return FORMATS["llama3_json"]
    if "SmolLM" in t:
        return FORMATS["smollm2"]
    return FORMATS["generic"]


def tool_format(tokenizer: Any) -> ToolFormat:
    """The format of `tokenizer`'s chat template (cached per tokenizer)."""
    try:
        return _chosen[tokenizer]
    except (KeyError, TypeError):
        fmt = format_of_template(getattr(tokenizer, "chat_template", None))
        try:
            _chosen[tokenizer] = fmt
        except TypeError:  # not weakly referenceable: decided again next time (a string scan)
            pass
        return fmt


def _arguments(call: dict) -> Any:
    """A history call's arguments as an object when they are JSON text (templates `tojson` them)."""
    args = call["function"]["arguments"]
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _append(content: Any, text: str) -> Any:
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return (content or "") + text


def _native_messages(messages: list[dict], one_call_each: bool) -> list[dict]:
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if not calls:
            out.append(m)
            continue
        calls = [{**c, "function": {**c["function"], "arguments": _arguments(c)}} for c in calls]
        groups = [[c] for c in calls] if one_call_each else [calls]
        for k, group in enumerate(groups):  # (Llama 3's template takes one call per message)
            out.append({**m, "content": m.get("content") if k == 0 else "", "tool_calls": group})
    return out


def _system_text(fmt: ToolFormat, tools: tuple[Tool, ...]) -> str:
    defs = [t.openai() for t in tools]
    if fmt.name == "smollm2":
        listing = "<tools>" + json.dumps(defs, ensure_ascii=False) + "</tools>"
        how = ("To call functions, answer with a JSON list of calls, each naming a function and giving its "
               'arguments:\n<tool_call>[{"name": "<function name>", "arguments": {<arguments>}}]</tool_call>')
    else:
        listing = "<tools>\n" + "\n".join(json.dumps(d, ensure_ascii=False) for d in defs) + "\n</tools>"
        how = ("To call a function, answer with one block per call, each a JSON object naming the function and "
               'giving its arguments:\n<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n'
               "</tool_call>")
    return f"You can call these functions, described as JSON inside <tools></tools>:\n{listing}\n{how}"


def _injected_messages(fmt: ToolFormat, messages: list[dict], tools: tuple[Tool, ...]) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if m["role"] == "tool":
            result = f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "_results": True})
            continue
        calls = m.get("tool_calls")
        if calls:
            written = [(c["function"]["name"], _written_arguments(c)) for c in calls]
            m = {"role": m["role"], "content": _append(m.get("content"), fmt.syntax.calls_text(written))}
        else:
            m = {"role": m["role"], "content": m.get("content") or ""}
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "_results"} for m in out]
    if tools:
        text = _system_text(fmt, tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": _append(out[0]["content"], "\n\n" + text)}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _written_arguments(call: dict) -> str:
    args = _arguments(call)
    return arguments_layout(args) if isinstance(args, (dict, list)) else str(args)


def render_prompt(fmt: ToolFormat, tokenizer: Any, messages: list[dict], tools: tuple[Tool, ...],
                  add_generation_prompt: bool = True) -> str:
    """The prompt text: `messages` (checked by validate.messages) with `tools` shown to the model."""
    try:
        if fmt.native:
            kw = {"tools": [t.openai() for t in tools]} if tools else {}
            return tokenizer.apply_chat_template(_native_messages(messages, not fmt.parallel),
                                                 add_generation_prompt=add_generation_prompt, **kw)
        return tokenizer.apply_chat_template(_injected_messages(fmt, messages, tools),
                                             add_generation_prompt=add_generation_prompt)
    except InvalidRequestError:
        raise
    except Exception as e:  # noqa: BLE001 - jinja templates raise whatever they like
        raise InvalidRequestError(f"messages: the chat template failed on them: {e}", param="messages") from None

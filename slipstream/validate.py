"""Type and range checks for values that cross a public boundary (API, CLI, worker, HTTP).

msgspec does not check types in a Struct's `__init__`, so every check here is explicit and raises
InvalidRequestError naming the field. `bool` is refused where an integer or a number is expected
(it is an `int` subclass: `max_tokens=True` would otherwise mean 1).
"""
from __future__ import annotations

import importlib
import json
import math
from typing import Any, Literal, cast, get_args, overload

import msgspec

from slipstream.errors import InvalidRequestError


class CheckedStructMeta(msgspec.StructMeta):
    """Struct construction errors (unknown keyword, missing field) become InvalidRequestError."""

    def __call__(cls, *args, **kwargs):
        try:
            return super().__call__(*args, **kwargs)
        except TypeError as e:  # msgspec's own: "Unexpected keyword argument 'n'"
            raise InvalidRequestError(f"{cls.__name__}: {e}") from None


def _type_name(value: Any) -> str:
    return type(value).__name__


@overload
def integer(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
            optional: Literal[False] = False) -> int: ...


@overload
def integer(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
            optional: bool) -> int | None: ...


def integer(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
            optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be an integer{' or None' if optional else ''}, "
                                  f"got {_type_name(value)} {value!r}", param=name)
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{name} must be >= {minimum}, got {value!r}", param=name)
    if maximum is not None and value > maximum:
        raise InvalidRequestError(f"{name} must be <= {maximum}, got {value!r}", param=name)
    return value


def number(name: str, value: Any) -> float:
    """A finite int or float (not bool)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {_type_name(value)} {value!r}", param=name)
    return float(value)


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false, got {_type_name(value)} {value!r}", param=name)
    return value


def text(name: str, value: Any, *, allow_empty: bool = False) -> str:
    """A str that encodes to UTF-8 (no lone surrogates)."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string, got {_type_name(value)} {value!r:.80}", param=name)
    if not value and not allow_empty:
        raise InvalidRequestError(f"{name} must not be empty", param=name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{name} is not valid Unicode text ({e.reason} at index {e.start})",
                                  param=name) from None
    return value


MAX_REGEX_EXPANSION = 20_000  # positions a regex's counted repetitions spell out (a{10000}: 10,000)


def regex(name: str, value: Any) -> str:
    """A regex whose counted repetitions stay within MAX_REGEX_EXPANSION positions: llguidance
    unrolls `{n}`, and `a{1000000}` took 1.3 s for its first mask, then failed at the first token
    ("too many expressions constructed"), mid-generation (issue 37). Syntax Python's `re` does not
    read (`\\p{L}`) is left to the grammar compiler."""
    value = text(name, value)
    size = _expansion(value)
    if size > MAX_REGEX_EXPANSION:
        raise InvalidRequestError(f"{name}: its counted repetitions ({{n}}, {{m,n}}) spell out {size:,} positions; "
                                  f"at most {MAX_REGEX_EXPANSION:,} are accepted", param=name)
    return value


def _expansion(pattern: str) -> int:
    # (CPython's regex parser: not in the type stubs)
    c = importlib.import_module("re._constants")
    re_parser = importlib.import_module("re._parser")

    try:
        parsed = re_parser.parse(pattern)
    except Exception:  # noqa: BLE001 - any syntax error: the grammar compiler's to report
        return 0
    repeats = {c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)}

    def size(items) -> int:
        total = 0
        for op, av in items:
            if op in repeats:
                lo, hi, sub = av
                total += (hi if hi != c.MAXREPEAT else lo + 1) * size(sub)  # (* and + loop: one copy)
            elif op is c.SUBPATTERN:
                total += size(av[-1])
            elif op is c.BRANCH:
                total += sum(size(b) for b in av[1])
            elif op is getattr(c, "ATOMIC_GROUP", None):
                total += size(av)
            else:
                total += 1
        return total

    return size(parsed)


def string_list(name: str, value: Any) -> list[str]:
    """None → [], a str → [str], a list of non-empty strings → itself."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a string or a list of strings, got {_type_name(value)} "
                                  f"{value!r:.80}",
                                  param=name)
    return [text(f"{name}[{i}]", s) for i, s in enumerate(value)]


def int_list(name: str, value: Any, *, minimum: int = 0) -> list[int]:
    """None → [], a list of integers >= minimum → itself."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a list of integers, got {_type_name(value)} {value!r:.80}",
                                  param=name)
    return [integer(f"{name}[{i}]", t, minimum=minimum) for i, t in enumerate(value)]


def token_ids(name: str, value: Any, vocab_size: int) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a string or a list of token ids, got {_type_name(value)} "
                                  f"{value!r:.80}", param=name)
    return [integer(f"{name}[{i}]", t, minimum=0, maximum=vocab_size - 1) for i, t in enumerate(value)]


def prompt(value: Any, vocab_size: int) -> str | list[int]:
    """A non-empty str (UTF-8 encodable) or a non-empty list of token ids in [0, vocab_size)."""
    if isinstance(value, str):
        return text("prompt", value)
    if isinstance(value, (bytes, bytearray)):
        raise InvalidRequestError("prompt must be a string or a list of token ids, got bytes (decode it first)",
                                  param="prompt")
    ids = token_ids("prompt", value, vocab_size)
    if not ids:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    return ids


ChatRole = Literal["system", "user", "assistant", "developer", "tool"]
CHAT_ROLES: tuple[str, ...] = get_args(ChatRole)


def messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI-style chat messages: [{"role": str, "content": str | [{"type": "text", "text": str}]}].
    An assistant message may carry `tool_calls` (its content may then be None), a tool message must
    carry its `tool_call_id` and may carry a `name`; they are kept, checked and normalised (`_tool_fields`)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidRequestError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, "
                                  f"got {_type_name(value)} {value!r:.80}", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be a dict with 'role' and 'content', got {_type_name(m)}",
                                      param=f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {CHAT_ROLES}, got {role!r}",
                                      param=f"messages[{i}].role")
        content = m.get("content")
        extra = _tool_fields(i, role, m)
        if content is None and "tool_calls" in extra:
            content = ""
        if isinstance(content, (list, tuple)):  # OpenAI content parts: text, and image slots
            parts: list[str | None] = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and part.get("type") == "image" and len(part) == 1:
                    parts.append(None)  # an image's place (api/image_prompt.split_chat_images took it out)
                    continue
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise InvalidRequestError(f"messages[{i}].content[{j}] must be a {{'type': 'text', 'text': ...}} "
                                              "part", param=f"messages[{i}].content[{j}]")
                parts.append(text(f"messages[{i}].content[{j}].text", part.get("text"), allow_empty=True))
            if None in parts:  # kept as parts: the chat template places the images
                out.append({"role": role, "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                                      for p in parts], **extra})
                continue
            content = "".join(cast(list[str], parts))  # (no image slot among them)
        out.append({"role": role, "content": text(f"messages[{i}].content", content, allow_empty=True), **extra})
    return out


def _tool_fields(i: int, role: str, m: dict) -> dict[str, Any]:
    """An assistant's `tool_calls` as [{"id", "type": "function", "function": {"name", "arguments": JSON
    text}}]; a tool message's `tool_call_id` and `name`. Fields other roles carry are ignored."""
    out: dict[str, Any] = {}
    if role == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, (list, tuple)):
            raise InvalidRequestError(f"messages[{i}].tool_calls must be a list", param=f"messages[{i}].tool_calls")
        out["tool_calls"] = [_history_call(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(calls)]
    if role == "tool":
        if m.get("tool_call_id") is None:  # (as OpenAI: a result answers a call, named by its id)
            raise InvalidRequestError(f"messages[{i}].tool_call_id: a tool message must name the call it answers",
                                      param=f"messages[{i}].tool_call_id")
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                out[key] = text(f"messages[{i}].{key}", m[key])
    return out


def _history_call(field: str, call: Any) -> dict[str, Any]:
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict):
        raise InvalidRequestError(f"{field} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                                  param=field)
    args = f.get("arguments")
    if isinstance(args, dict):
        args = json.dumps(args)
    return {"id": text(f"{field}.id", call.get("id", ""), allow_empty=True), "type": "function",
            "function": {"name": text(f"{field}.function.name", f.get("name")),
                         "arguments": text(f"{field}.function.arguments", args, allow_empty=True)}}


def request_id(value: Any) -> str | None:
    if value is None:
        return None
    return text("request_id", value)

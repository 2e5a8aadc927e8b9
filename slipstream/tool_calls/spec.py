"""A request's tools, checked at the entry: function definitions, `tool_choice`, `parallel_tool_calls`.

Every entry (Engine, Client, LLM, the worker, HTTP) takes tools in OpenAI's shapes and refuses a
bad one with InvalidRequestError naming the field (`tools[1].function.parameters`, `tool_choice`):
a name that is not `[A-Za-z0-9_-]{1,64}`, a name given twice, parameters that are not a JSON
object schema or that llguidance cannot compile, more than MAX_TOOLS tools or more than
MAX_TOOLS_CHARS of definitions, a `tool_choice` naming a function that is not in `tools`.
"""
from __future__ import annotations

import json
from typing import Any, cast

import msgspec

from slipstream.errors import InvalidRequestError
from slipstream.grammar.tool_calls import TOOL_NAME, parameters_error

MAX_TOOLS = 128  # as OpenAI
MAX_TOOLS_CHARS = 256 * 1024  # the definitions as JSON: they are rendered into the prompt and compiled
CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class Tool(msgspec.Struct, frozen=True):
    """A function the model may call; `parameters` is the JSON schema of its arguments object."""

    name: str
    description: str | None = None
    parameters: dict | None = None  # None: the function takes no arguments ({})

    def schema_text(self) -> str:
        return json.dumps(self.parameters if self.parameters is not None else NO_PARAMETERS)

    def openai(self) -> dict:
        """The chat API's definition, as chat templates that render tools read it."""
        f: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            f["description"] = self.description
        f["parameters"] = self.parameters if self.parameters is not None else NO_PARAMETERS
        return {"type": "function", "function": f}


class ToolRequest(msgspec.Struct, frozen=True):
    """The tools of one request and how it may use them."""

    tools: tuple[Tool, ...]
    choice: str  # "none" | "auto" | "required" (a named function: "required" with only that tool in `callable`)
    parallel: bool
    named: str | None = None  # tool_choice named this function

    @property
    def callable(self) -> tuple[Tool, ...]:
        return tuple(t for t in self.tools if t.name == self.named) if self.named else self.tools


def _field(i: int, flat: bool) -> str:
    return f"tools[{i}]" if flat else f"tools[{i}].function"


def _tool(i: int, t: Any) -> tuple[Tool, str]:
    """The checked tool and its field ("tools[i].function" or, in the flat shape, "tools[i]")."""
    if isinstance(t, Tool):
        d, flat = {"name": t.name, "description": t.description, "parameters": t.parameters}, True
    elif isinstance(t, dict):
        if t.get("type", "function") != "function":
            raise InvalidRequestError(f"tools[{i}].type: only function tools are supported, got {t.get('type')!r}",
                                      param=f"tools[{i}].type")
        flat = "function" not in t  # the Responses API's shape: {"type": "function", "name": ...}
        d = t if flat else t["function"]
        if not isinstance(d, dict):
            raise InvalidRequestError(f"tools[{i}].function must be an object", param=f"tools[{i}].function")
    else:
        raise InvalidRequestError(f"tools[{i}] must be a function tool object, got {type(t).__name__}",
                                  param=f"tools[{i}]")
    field = _field(i, flat)
    name = d.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise InvalidRequestError(f"{field}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}",
                                  param=f"{field}.name")
    desc = d.get("description")
    if desc is not None and not isinstance(desc, str):
        raise InvalidRequestError(f"{field}.description must be a string", param=f"{field}.description")
    params = d.get("parameters")
    if params == {}:  # (as no parameters: the function takes an empty arguments object, not any JSON value)
        params = None
    if params is not None:
        _check_parameters(params, f"{field}.parameters")
    return Tool(name, desc, cast("dict | None", params)), field  # (checked: an object or None)


def _check_parameters(params: Any, field: str) -> None:
    if not isinstance(params, dict):
        raise InvalidRequestError(f"{field} must be a JSON schema object, got {type(params).__name__}", param=field)
    if not describes_object(params):
        # the grammar would let the model write a scalar or a list where a call's arguments object goes
        kind = params.get("type")
        got = f"type {kind!r:.80}" if kind is not None else f"a schema without a type (keys {sorted(params)!r:.80})"
        raise InvalidRequestError(f"{field} must describe a JSON object (\"type\": \"object\", or a $ref, allOf, "
                                  f"anyOf or oneOf that resolves to objects only), got {got}", param=field)
    try:
        text = json.dumps(params)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidRequestError(f"{field} is not JSON: {type(e).__name__}: {e}", param=field) from None
    error = parameters_error(text)
    if error:
        raise InvalidRequestError(f"{field} is not a usable JSON schema: {error}", param=field)


def describes_object(schema: Any, root: Any = None, refs: frozenset[str] = frozenset()) -> bool:
    """Whether every value `schema` accepts is a JSON object, judged conservatively: `type` object
    (alone in a list), a `const` or `enum` of objects, a local `$ref` to such a schema, an `allOf`
    with one, an `anyOf` / `oneOf` of them only. Anything this cannot tell is not an object."""
    root = schema if root is None else root
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "object" or kind == ["object"]:
        return True
    if "const" in schema:
        return isinstance(schema["const"], dict)
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, dict) for v in enum):
        return True
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref not in refs and describes_object(_resolve(root, ref), root, refs | {ref}):
        return True
    every = schema.get("allOf")
    if isinstance(every, list) and any(describes_object(s, root, refs) for s in every):
        return True
    for key in ("anyOf", "oneOf"):
        some = schema.get(key)
        if isinstance(some, list) and some and all(describes_object(s, root, refs) for s in some):
            return True
    return False


def _resolve(root: Any, ref: str) -> Any:
    """A local `$ref` ("#", "#/$defs/x": a JSON pointer into the root), or None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None  # (remote references: llguidance refuses them too)
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _named(choice: dict) -> str:
    """{"type": "function", "function": {"name": ...}} (chat) or {"type": "function", "name": ...} (Responses)."""
    if choice.get("type") != "function":
        raise InvalidRequestError(f"tool_choice: an object must be {{'type': 'function', ...}}, got "
                                  f"type {choice.get('type')!r:.80}", param="tool_choice")
    inner = choice.get("function", choice)
    name = inner.get("name") if isinstance(inner, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError("tool_choice: name the function to call", param="tool_choice")
    return name


def tool_request(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = True) -> ToolRequest | None:
    """The checked ToolRequest, or None when the request has neither tools nor a tool_choice."""
    if tools is None and tool_choice is None:
        return None
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    if not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError(f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r:.80}",
                                  param="parallel_tool_calls")
    tools = [] if tools is None else tools
    if not isinstance(tools, (list, tuple)):
        raise InvalidRequestError(f"tools must be a list of function tools, got {type(tools).__name__}",
                                  param="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: {len(tools)} tools; at most {MAX_TOOLS} are accepted", param="tools")
    checked: list[Tool] = []
    seen: dict[str, int] = {}
    for i, given in enumerate(tools):
        t, field = _tool(i, given)
        if t.name in seen:
            raise InvalidRequestError(f"{field}.name: the function name {t.name!r} is also tools[{seen[t.name]}]'s",
                                      param=f"{field}.name")
        seen[t.name] = i
        checked.append(t)
    size = sum(len(t.schema_text()) + len(t.description or "") for t in checked)
    if size > MAX_TOOLS_CHARS:
        raise InvalidRequestError(f"tools: the definitions have {size:,} characters; at most {MAX_TOOLS_CHARS:,} "
                                  "are accepted", param="tools")
    named = None
    if tool_choice is None:
        choice = "auto" if checked else "none"
    elif isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise InvalidRequestError(f"tool_choice must be one of {CHOICES} or a named function, got "
                                      f"{tool_choice!r:.80}", param="tool_choice")
        choice = tool_choice
    elif isinstance(tool_choice, dict):
        named, choice = _named(tool_choice), "required"
        if named not in seen:
            raise InvalidRequestError(f"tool_choice names the function {named!r:.80}, which is not in tools "
                                      f"({', '.join(seen) or 'none given'})", param="tool_choice")
    else:
        raise InvalidRequestError(f"tool_choice must be a string or a named function, got "
                                  f"{type(tool_choice).__name__}", param="tool_choice")
    if choice in ("auto", "required") and not checked:
        if choice == "required":
            raise InvalidRequestError("tool_choice 'required' needs tools", param="tool_choice")
        choice = "none"  # auto without tools: a plain answer
    return ToolRequest(tuple(checked), choice, parallel_tool_calls and named is None, named)


def check_history(messages: list[dict], request: ToolRequest | None) -> None:
    """The names of a conversation's calls (checked messages): OpenAI's rule for names, and, when the
    request has tools, one of them (a call of another function is not one the model could write)."""
    names = {t.name for t in request.tools} if request is not None and request.tools else None
    for i, m in enumerate(messages):
        for j, call in enumerate(m.get("tool_calls") or ()):
            name, field = call["function"]["name"], f"messages[{i}].tool_calls[{j}].function.name"
            if not TOOL_NAME.fullmatch(name):
                raise InvalidRequestError(f"{field} must be 1 to 64 letters, digits, '_' or '-', got {name!r:.80}",
                                          param=field)
            if names is not None and name not in names:
                raise InvalidRequestError(f"{field}: {name!r} is not one of the request's tools "
                                          f"({', '.join(sorted(names))})", param=field)

"""Spatial skills on top of Engine: point / detect / segment with Moondream-compatible results.

The grammar (slipstream/grammar/skills.py) forces the layout token by token; this module builds the
prompt, sizes max_tokens from max_objects, and turns the text into the result dict. Streaming
variants yield each object as soon as its line is complete.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec

from slipstream.errors import InvalidRequestError
from slipstream.grammar.base import GrammarSpec
from slipstream.grammar.skills import parse_skill_output
from slipstream.params import SamplingParams

if TYPE_CHECKING:
    from slipstream.api.engine import Engine

# tokens per object line: values × (up to 4 digits + 1 separator)
_VALUES = {"point": 2, "detect": 4, "segment": 2}
_INSTRUCTION = {
    "point": "Point at every {obj}. Answer with one 'x y' line per point, coordinates 0-1023.",
    "detect": "Detect every {obj}. Answer with one 'cx cy w h' line per box, coordinates 0-1023.",
    "segment": "Outline the {obj}. Answer with its bounding box 'x0 y0 x1 y1', then one 'x y' line per "
               "outline point, coordinates 0-1023.",
}


def skill_request(engine: "Engine", kind: str, prompt: str, obj: str, max_objects: int,
                  params: SamplingParams | None) -> tuple[str, SamplingParams]:
    text = f"{prompt}\n\n{_INSTRUCTION[kind].format(obj=obj)}" if prompt else _INSTRUCTION[kind].format(obj=obj)
    if getattr(engine.tokenizer, "chat_template", None):
        text = engine.chat_prompt([{"role": "user", "content": text}])
    lines = max_objects + (1 if kind == "segment" else 0)
    budget = lines * _VALUES[kind] * 5 + 2 + (4 * 5 if kind == "segment" else 0)
    base = params or SamplingParams(temperature=0.0)
    if base.n != 1:
        raise InvalidRequestError("a skill returns one result: n must be 1 (call it n times)", param="n")
    spec = GrammarSpec(kind, obj, max_objects)
    return text, msgspec.structs.replace(base, max_tokens=min(base.max_tokens, budget) if params else budget,
                                         grammar=spec, json_schema=None, regex=None, choice=None)


async def run_skill(engine: "Engine", kind: str, prompt: str, obj: str, max_objects: int = 16,
                    params: SamplingParams | None = None) -> dict[str, Any]:
    text, sp = skill_request(engine, kind, prompt, obj, max_objects, params)
    out = await engine.complete(text, sp)
    return parse_skill_output(kind, out.text)


async def stream_skill(engine: "Engine", kind: str, prompt: str, obj: str, max_objects: int = 16,
                       params: SamplingParams | None = None) -> AsyncIterator[dict[str, Any]]:
    """point/detect: yields each object dict as its line completes. segment: yields the final dict."""
    text, sp = skill_request(engine, kind, prompt, obj, max_objects, params)
    acc, done = "", 0
    key = {"point": "points", "detect": "objects"}.get(kind)
    async for delta in engine.stream(text, sp):
        acc += delta.text
        if key is None or "\n" not in delta.text:
            continue
        objs = parse_skill_output(kind, acc)[key]
        for o in objs[done:]:
            yield o
        done = len(objs)
    if key is None:
        yield parse_skill_output(kind, acc)

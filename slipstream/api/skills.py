"""Spatial skills on top of the EngineAPI: point / detect / segment with Moondream-compatible results.

The grammar (slipstream/grammar/skills.py) forces the layout token by token; this module builds the
prompt, sizes max_tokens from max_objects, and turns the text into the result dict. Streaming
variants yield each object as soon as its line is complete. Written against the interface only
(slipstream/api/interface.py), so an Engine and a Client run the same requests: the instruction goes
through the model's chat template when it has one (`health().chat_template`), else as plain text.
`images`: the picture(s) the skill looks at, one `<image>` marker each before the instruction; for
Idefics3 the answer stays grammar-constrained text.

A model with region heads (Moondream; `health().region_skills`) answers point/detect with them
instead: the engine builds the model's own prompt template from the object name and the region
grammar (grammar/region.py), and the result comes from the values the heads decoded
(`CompletionOutput.carried`), not from text (docs/moondream.md, "point and detect").
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence, cast

import msgspec

from slipstream.errors import InvalidRequestError
from slipstream.grammar.base import GrammarSpec
from slipstream.grammar.region import REGION_KINDS, region_result, tokens_per_object
from slipstream.grammar.skills import parse_skill_output
from slipstream.outputs import CompletionOutput
from slipstream.params import SamplingParams

if TYPE_CHECKING:
    from slipstream.api.interface import DeltaStream, EngineAPI
    from slipstream.images import ImageLike

# tokens per object line: values × (up to 4 digits + 1 separator)
_VALUES = {"point": 2, "detect": 4, "segment": 2}
_INSTRUCTION = {
    "point": "Point at every {obj}. Answer with one 'x y' line per point, coordinates 0-1023.",
    "detect": "Detect every {obj}. Answer with one 'cx cy w h' line per box, coordinates 0-1023.",
    "segment": "Outline the {obj}. Answer with its bounding box 'x0 y0 x1 y1', then one 'x y' line per "
               "outline point, coordinates 0-1023.",
}


MAX_OBJECTS = 4096  # as the HTTP grammar field's bound


def check_skill_args(prompt: str, obj: str, max_objects: int) -> None:
    """The arguments every entry (Engine, Client, LLM, HTTP) shares, each refusal naming its field."""
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"prompt: must be a string, got {type(prompt).__name__}", param="prompt")
    if not isinstance(obj, str) or not obj.strip():
        raise InvalidRequestError(f"object: give the object name to look for, got {obj!r:.80}", param="object")
    if isinstance(max_objects, bool) or not isinstance(max_objects, int) or not 1 <= max_objects <= MAX_OBJECTS:
        raise InvalidRequestError(f"max_objects: must be an integer from 1 to {MAX_OBJECTS}, got {max_objects!r:.80}",
                                  param="max_objects")


def skill_request(kind: str, prompt: str, obj: str, max_objects: int,
                  params: SamplingParams | None) -> tuple[str, SamplingParams]:
    """The instruction text (before any chat template) and the constrained SamplingParams."""
    if kind not in _VALUES:
        raise InvalidRequestError(f"kind: unknown skill {kind!r} (expected one of {', '.join(_VALUES)})",
                                  param="kind")
    check_skill_args(prompt, obj, max_objects)
    text = f"{prompt}\n\n{_INSTRUCTION[kind].format(obj=obj)}" if prompt else _INSTRUCTION[kind].format(obj=obj)
    lines = max_objects + (1 if kind == "segment" else 0)
    budget = lines * _VALUES[kind] * 5 + 2 + (4 * 5 if kind == "segment" else 0)
    base = params or SamplingParams(temperature=0.0)
    if base.n != 1:
        raise InvalidRequestError("a skill returns one result: n must be 1 (call it n times)", param="n")
    spec = GrammarSpec(kind, obj, max_objects)
    return text, msgspec.structs.replace(base, max_tokens=min(base.max_tokens, budget) if params else budget,
                                         grammar=spec, json_schema=None, regex=None, choice=None)


def region_request(kind: str, obj: str, max_objects: int, params: SamplingParams | None) -> SamplingParams:
    """SamplingParams of a region skill: one token per value (x, y, and detect's size) per object,
    then EOS; greedy unless `params` say otherwise."""
    check_skill_args("", obj, max_objects)  # (the prompt is refused by the engine: the template is fixed)
    base = params or SamplingParams(temperature=0.0)
    if base.n != 1:
        raise InvalidRequestError("a skill returns one result: n must be 1 (call it n times)", param="n")
    budget = tokens_per_object(kind) * max_objects + 1
    return msgspec.structs.replace(base, max_tokens=min(base.max_tokens, budget) if params else budget,
                                   grammar=GrammarSpec(kind, obj, max_objects), json_schema=None, regex=None,
                                   choice=None)


async def _region_skills(api: "EngineAPI", kind: str) -> bool:
    return kind in REGION_KINDS and bool(getattr(await api.health(), "region_skills", False))


def _with_images(text: str, images: Sequence[ImageLike]) -> str:
    """One `<image>` marker per image, before the instruction (the model sees the picture first)."""
    return "<image>" * len(images) + "\n" + text if images else text


async def run_skill(api: "EngineAPI", kind: str, prompt: str, obj: str, max_objects: int = 16,
                    params: SamplingParams | None = None, images: Sequence[ImageLike] = ()) -> dict[str, Any]:
    if await _region_skills(api, kind):  # the engine refuses a non-empty prompt (the template is fixed)
        # an empty prompt is the image's marker alone: a Client refuses empty prompts
        out = await api.complete(prompt or "<image>", region_request(kind, obj, max_objects, params), images=images)
        return region_result(kind, cast(CompletionOutput, out).carried)  # (n == 1: one output)
    text, sp = skill_request(kind, prompt, obj, max_objects, params)
    text = _with_images(text, images)
    # (a text model refuses images, naming the field; none given is the default)
    if (await api.health()).chat_template:
        out = await api.chat([{"role": "user", "content": text}], sp, images=images)
    else:
        out = await api.complete(text, sp, images=images)
    return parse_skill_output(kind, cast(CompletionOutput, out).text)  # (n == 1: one output)


async def stream_skill(api: "EngineAPI", kind: str, prompt: str, obj: str, max_objects: int = 16,
                       params: SamplingParams | None = None,
                       images: Sequence[ImageLike] = ()) -> AsyncIterator[dict[str, Any]]:
    """point/detect: yields each object dict as its line completes. segment: yields the final dict.
    On a model with region heads, point/detect yield their objects when the request finishes (the
    values ride the final output, not the stream's deltas)."""
    if await _region_skills(api, kind):
        result = await run_skill(api, kind, prompt, obj, max_objects, params, images)
        for o in result["points" if kind == "point" else "objects"]:
            yield o
        return
    text, sp = skill_request(kind, prompt, obj, max_objects, params)
    text = _with_images(text, images)
    deltas: DeltaStream
    if (await api.health()).chat_template:
        deltas = api.chat_stream([{"role": "user", "content": text}], sp, images=images)
    else:
        deltas = api.stream(text, sp, images=images)
    acc, done = "", 0
    key = {"point": "points", "detect": "objects"}.get(kind)
    try:
        async for delta in deltas:
            acc += delta.text
            if key is None or "\n" not in delta.text:
                continue
            objs = parse_skill_output(kind, acc)[key]
            for o in objs[done:]:
                yield o
            done = len(objs)
    finally:
        await deltas.aclose()  # the caller left early: abort the request now
    if key is None:
        yield parse_skill_output(kind, acc)


class SkillMethods:
    """point / detect / segment / stream_skill of the EngineAPI, for Engine and Client alike."""

    async def point(self, prompt: str, object: str, max_objects: int = 16,
                    params: SamplingParams | None = None, *,
                    images: Sequence[ImageLike] = ()) -> dict[str, Any]:
        return await run_skill(cast("EngineAPI", self), "point", prompt, object, max_objects, params, images)

    async def detect(self, prompt: str, object: str, max_objects: int = 16,
                     params: SamplingParams | None = None, *,
                     images: Sequence[ImageLike] = ()) -> dict[str, Any]:
        return await run_skill(cast("EngineAPI", self), "detect", prompt, object, max_objects, params, images)

    async def segment(self, prompt: str, object: str, max_objects: int = 16,
                      params: SamplingParams | None = None, *,
                      images: Sequence[ImageLike] = ()) -> dict[str, Any]:
        return await run_skill(cast("EngineAPI", self), "segment", prompt, object, max_objects, params, images)

    def stream_skill(self, kind: str, prompt: str, object: str, max_objects: int = 16,
                     params: SamplingParams | None = None, *,
                     images: Sequence[ImageLike] = ()) -> AsyncIterator[dict[str, Any]]:
        """Async iterator of objects as they complete (point/detect), or the final dict (segment)."""
        return stream_skill(cast("EngineAPI", self), kind, prompt, object, max_objects, params, images)

"""`LLM`: the synchronous API for scripts and notebooks (vLLM's `LLM.generate([...])` shape).

An `Engine` needs its own event loop; here it gets one on a background thread, and every method
blocks until the engine has answered. Calls may come from any thread, including one that runs an
event loop of its own (a notebook): the engine's loop is never the caller's.
"""
from __future__ import annotations

import asyncio
import functools
import threading
from typing import Sequence

from slipstream import validate as check
from slipstream.api.engine import Engine, Prompt
from slipstream.api.interface import ToolChoice, Tools
from slipstream.api.skills import check_skill_args
from slipstream.errors import EngineClosedError, InvalidRequestError
from slipstream.images import (ImageInput, ImageLike, ImageLimits, check_image_count, image_list, load_request_images,
                               model_accepts_images, require_vision)
from slipstream.outputs import CompletionOutput
from slipstream.params import EngineConfig, SamplingParams
from slipstream.tool_calls.spec import tool_request


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        self.engine = Engine(config, **overrides)  # (a bad config raises before the thread exists)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slipstream-llm", daemon=True)
        self._thread.start()
        try:
            self._call(self.engine.start())
        except BaseException:
            self._stop_loop()
            raise

    # --- requests -------------------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 images: Sequence[ImageLike] | Sequence[Sequence[ImageLike]] | None = None
                 ) -> list[CompletionOutput | list[CompletionOutput]]:
        """Complete one prompt or a list of them (all at once, batched by the engine); outputs in order.
        A prompt is a string or a list of token ids; `params` is one SamplingParams or one per prompt.
        A prompt whose params have n > 1 gets a list of n outputs in its place. `images`: for one
        prompt, a list of images (PIL, bytes, paths, data: URLs) for its `<image>` markers; for a
        list of prompts, one such list per prompt. They are decoded and checked before any prompt
        is submitted (errors name e.g. `images[1][0]`)."""
        single = _is_single(prompts)
        batch = [prompts] if single else _batch(prompts, "prompts")
        per_prompt = _per_prompt(params, len(batch))
        self._check_ready()
        for i, p in enumerate(batch):  # every prompt's type before any is submitted
            try:
                check.prompt(p, self.engine.model_config.vocab_size)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"prompts[{i}]: {e}", param=f"prompts[{i}]") from None
        per_images = self._images(images, len(batch), single)
        calls = [_naming(f"prompts[{i}]", "prompt", self.engine.complete if not imgs else
                         lambda x, p, imgs=imgs: self.engine.complete(x, p, images=imgs))
                 for i, imgs in enumerate(per_images)]
        return self._call(self._gather_each(calls, batch, per_prompt))

    def _images(self, images, n: int, single: bool) -> list[list[ImageInput]]:
        """One list of decoded images per prompt; a text model refuses them naming the first."""
        if images is None:
            return [[] for _ in range(n)]
        lists = [image_list(images)] if single else image_list(images)
        names = ["images"] if single else [f"images[{k}]" for k in range(len(lists))]
        if len(lists) != n:
            raise InvalidRequestError(f"images: {len(lists)} lists of images for {n} prompts", param="images")
        out = []
        for name, objs in zip(names, lists):
            objs = image_list(objs, name)
            check_image_count(len(objs), f"{name}[{ImageLimits().max_images}]", ImageLimits())
            if objs:
                require_vision(model_accepts_images(self.engine.model_config), f"{name}[0]")
            out.append(load_request_images(objs, [f"{name}[{i}]" for i in range(len(objs))]))
        return out

    def chat(self, conversations: list[dict] | Sequence[list[dict]],
             params: SamplingParams | Sequence[SamplingParams] | None = None, *, tools: Tools = None,
             tool_choice: ToolChoice = None, parallel_tool_calls: bool = True
             ) -> list[CompletionOutput | list[CompletionOutput]]:
        """Answer one conversation (a list of {"role", "content"} messages) or a list of them (n > 1: as generate).
        Content may be a list of OpenAI parts, images included ({"type": "image", "image": ...} or
        {"type": "image_url", ...}); they pass through to Engine.chat. `tools` (the same for every
        conversation): each output's `content` and `tool_calls` (docs/tools.md)."""
        single = isinstance(conversations, list) and (not conversations or isinstance(conversations[0], dict))
        batch = [conversations] if single else _batch(conversations, "conversations")
        per_prompt = _per_prompt(params, len(batch))
        for i, messages in enumerate(batch):
            image_fields = _image_parts(messages, f"conversations[{i}]")
            if image_fields:  # the engine validates parts with images; a text model refuses them here
                self._check_ready()
                require_vision(model_accepts_images(self.engine.model_config), image_fields[0])
                continue
            try:
                check.messages(messages)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"conversations[{i}]: {e}", param=f"conversations[{i}]") from None
        chat = self.engine.chat
        if tools is not None or tool_choice is not None:
            tool_request(tools, tool_choice, parallel_tool_calls)  # refused before anything runs
            chat = functools.partial(chat, tools=tools, tool_choice=tool_choice,
                                     parallel_tool_calls=parallel_tool_calls)
        calls = [_naming(f"conversations[{i}]", "messages", chat) for i in range(len(batch))]
        return self._call(self._gather_each(calls, batch, per_prompt))

    # --- skills (slipstream/api/skills.py): Moondream-compatible result dicts ------------------

    def point(self, prompt: str, object: str, max_objects: int = 16, params: SamplingParams | None = None, *,
              images: Sequence[ImageLike] = ()) -> dict:
        """`{"points": [{"x", "y"}, ...]}` (0-1) of each `object` in the image(s): `Engine.point`."""
        return self._skill("point", prompt, object, max_objects, params, images)

    def detect(self, prompt: str, object: str, max_objects: int = 16, params: SamplingParams | None = None, *,
               images: Sequence[ImageLike] = ()) -> dict:
        """`{"objects": [{"x_min", "y_min", "x_max", "y_max"}, ...]}` (0-1): `Engine.detect`."""
        return self._skill("detect", prompt, object, max_objects, params, images)

    def segment(self, prompt: str, object: str, max_objects: int = 16, params: SamplingParams | None = None, *,
                images: Sequence[ImageLike] = ()) -> dict:
        """`{"path", "bbox"}`: `Engine.segment`."""
        return self._skill("segment", prompt, object, max_objects, params, images)

    def _skill(self, kind: str, prompt, obj, max_objects, params, images) -> dict:
        self._check_ready()
        check_skill_args(prompt, obj, max_objects)
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}", param="params")
        loaded = self._images(images, 1, True)[0] if images else []  # decoded and checked before submitting
        return self._call(getattr(self.engine, kind)(prompt, obj, max_objects, params, images=loaded))

    def stats(self) -> dict:
        return self._call(self.engine.stats())

    # --- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._call(self.engine.close())
        finally:
            self._stop_loop()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ------------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self._loop.is_closed():
            raise EngineClosedError("this LLM is closed")

    def _call(self, coro):
        """Run `coro` on the engine's loop and wait. If this thread stops waiting (Ctrl-C, any
        exception), the coroutine is cancelled, which aborts its requests, and that has happened
        by the time the exception goes on: no request outlives the call."""
        if self._loop.is_closed():
            coro.close()
            raise EngineClosedError("this LLM is closed")
        settled = threading.Event()

        async def run():
            try:
                return await coro
            finally:
                settled.set()

        future = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            settled.wait(timeout=_SETTLE_S)
            raise

    @staticmethod
    async def _gather_each(methods: list, inputs: list, params: list) -> list:
        """All at once; the first failure cancels (aborts) the rest before it is raised."""
        tasks = [asyncio.ensure_future(m(x, p)) for m, x, p in zip(methods, inputs, params)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()  # complete() aborts its request when cancelled
            await asyncio.gather(*tasks, return_exceptions=True)  # (and marks every error as seen)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


_SETTLE_S = 30.0  # how long an interrupted call waits for its requests' aborts


def _naming(name: str, field: str, method):
    """`method` whose InvalidRequestError about `field` (the engine's name for its one input) names
    the input of this call instead: `prompt` -> `prompts[1]`, `prompt[3]` -> `prompts[1][3]`."""
    async def call(x, p):
        try:
            return await method(x, p)
        except InvalidRequestError as e:
            param = e.param or ""
            if param != field and not param.startswith(field + "["):
                raise
            raise InvalidRequestError(f"{name}: {e}", param=name + param[len(field):]) from None
    return call


def _image_parts(messages, name: str) -> list[str]:
    """Fields of the image parts in one conversation (e.g. conversations[0][1].content[2])."""
    if not isinstance(messages, (list, tuple)):
        return []
    return [f"{name}[{j}].content[{k}]" for j, m in enumerate(messages)
            if isinstance(m, dict) and isinstance(m.get("content"), (list, tuple))
            for k, part in enumerate(m["content"])
            if isinstance(part, dict) and part.get("type") in ("image", "image_url")]


def _batch(items, name: str) -> list:
    if not isinstance(items, (list, tuple)):
        raise InvalidRequestError(f"{name} must be a prompt or a list of them, got {type(items).__name__} "
                                  f"{items!r:.80}", param=name)
    return list(items)


def _is_single(prompts) -> bool:
    """A str, or a list of token ids (ints), is one prompt; a list of those is a batch."""
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], int)


def _per_prompt(params, n: int) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)):
        raise InvalidRequestError(f"params must be a SamplingParams or a list of them, got {type(params).__name__}",
                                  param="params")
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(f"params: {len(params)} SamplingParams for {n} prompts", param="params")
    return params


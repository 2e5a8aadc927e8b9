"""The public async API in this process: Engine(EngineConfig) implements EngineAPI (interface.py).

This file holds the Engine's lifecycle (start, close: the parts, the engine loop's task, the gc
hold) and its public methods; how a request is checked, prepared and handed to the loop is the
`Submitter` it holds (slipstream/api/engine_submit.py), which also keeps the table of live requests.
"""
from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING, Any, Self, Sequence, cast

import structlog

from slipstream import gc_freeze
from slipstream.errors import EngineAlreadyStartedError, EngineClosedError, InvalidRequestError, WrongEventLoopError
from slipstream.outputs import CompletionOutput
from slipstream.params import EngineConfig, SamplingParams
from slipstream.models.tokenizers.byte_stream import byte_table
from slipstream.api.interface import DeltaStream, Messages, Prompt, ToolChoice, Tools
from slipstream.api.engine_submit import Submitter
from slipstream.api.fanout import fan_out, wants_fan_out
from slipstream.api.image_prompt import split_chat_images
from slipstream.api.protocol import HealthReply
from slipstream.api.request_stream import RequestStream
from slipstream.api.skills import SkillMethods
from slipstream.tool_calls.plan import make_plan
from slipstream.images import ImageLike, require_vision

if TYPE_CHECKING:
    from slipstream.api.assemble import EngineParts

log = structlog.get_logger(__name__)


# the layers the engine loop's task runs (and its stream threads): their frames are finished
# once the task is done; other frames of a traceback may be a caller's, still suspended, which
# frame.clear() would close
_LOOP_CODE = tuple(os.path.join(os.path.dirname(os.path.dirname(__file__)), d) + os.sep
                   for d in ("scheduler", "runtime", "models"))


def clear_loop_frames(*errors: BaseException) -> None:
    """Drop the locals of the engine loop's frames in each error's traceback (its causes' and
    contexts' too): the lines stay printable, and an error a caller keeps no longer holds the
    loop, the runner and the KV cache through them."""
    seen: set[int] = set()
    todo = list(errors)
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.startswith(_LOOP_CODE):
                try:
                    tb.tb_frame.clear()
                except RuntimeError:  # still executing (a thread's)
                    pass
            tb = tb.tb_next
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]


def encoder_cache_stats(cache, bytes_per_row: int) -> dict[str, Any]:
    """The encoder cache's counters for stats() (images for hits/misses/entries; zeros without images)."""
    st = cache.stats()
    return {"encoder_cache_hits": st.hits, "encoder_cache_misses": st.misses, "encoder_cache_entries": st.entries,
            "encoder_cache_bytes": st.features * bytes_per_row, "encoder_cache_evictions": st.evictions}


def prefix_cache_stats(cache) -> dict[str, Any]:
    """The prefix cache's counters for stats() (tokens for queries and hits); zeros with caching off."""
    if cache is None:
        return {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_hit_rate": 0.0,
                "prefix_cache_cached_pages": 0, "prefix_cache_evictions": 0}
    st = cache.stats()
    return {"prefix_cache_queries": st.queries, "prefix_cache_hits": st.hits,
            "prefix_cache_hit_rate": st.hits / st.queries if st.queries else 0.0,
            "prefix_cache_cached_pages": st.cached_pages, "prefix_cache_evictions": st.evictions}


class Engine(SkillMethods):
    _parts: EngineParts  # set by start()

    def __init__(self, config: EngineConfig | None = None, **overrides):
        if config is not None and not isinstance(config, EngineConfig):
            raise InvalidRequestError(f"config must be an EngineConfig, got {type(config).__name__} (keywords: "
                                      "Engine(model=...) or Engine(EngineConfig(...)))", param="config")
        self.config = config or EngineConfig(**overrides)
        self._loop_task: asyncio.Task | None = None
        self._owner: asyncio.AbstractEventLoop | None = None
        self.submitter = Submitter(self.config, self._check_running)  # requests in, and their table
        self.tokenizer: Any = None
        self.model_config: Any = None  # ModelConfig's fields, once started
        self._gc_held = False  # gc_freeze.hold() called, release() not yet
        self._closed = False  # close() ran (its parts are let go)

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> Self:
        from slipstream.api.assemble import assemble  # torch-heavy imports happen at start

        if not isinstance(self.config, EngineConfig):
            raise InvalidRequestError(f"config must be an EngineConfig, got {type(self.config).__name__}",
                                      param="config")
        if self._loop_task is not None:
            raise EngineAlreadyStartedError("engine already started: close() it before starting it again")
        self._closed = False
        self._owner = asyncio.get_running_loop()
        # before the parts exist: only the libraries and what the application had are frozen, never
        # an engine (gc_freeze.py); counted for every engine, so none freezes while another runs
        gc_freeze.hold(self.config.freeze_gc)
        self._gc_held = True
        parts = None
        try:
            parts = self._parts = await asyncio.to_thread(assemble, self.config)
            self.tokenizer, self.model_config = parts.tokenizer, parts.model_config
            await asyncio.to_thread(byte_table, self.tokenizer)  # built once here, not on the first request
            self.loop = self._parts.loop
            self.max_model_len = self._parts.max_model_len
            from slipstream.grammar.compiler import GrammarCompiler

            from slipstream.grammar.region import region_factories

            region = getattr(self._parts.image_processing, "region_tokens", None)  # Moondream: point/detect
            grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                       timeout_s=self.config.grammar_timeout_s,
                                       factories=region_factories(*region) if region else None)
            self.submitter.bind(self.config, self._parts, grammars)
            await self._start_loras()
            self._loop_task = asyncio.create_task(self.loop.run(), name="slipstream-engine-loop")
            self._loop_task.add_done_callback(self._loop_ended)
        except BaseException:  # a failed start leaves no device threads and no gc hold behind
            if parts is not None:
                parts.close()
            self._gc_held = False
            gc_freeze.release()
            raise
        log.info("engine_started", model=self.config.model, device=self.config.device,
                 pipeline_depth=self.config.pipeline_depth, kv_pages=self._parts.pool.total)
        return self

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The engine loop's task is done (its own coroutine, so no frame of this file is resumed
        with it at every step)."""
        if task.cancelled():
            # cancelled, not closed: asyncio.run() tearing down after the application raised. The
            # device's threads stop now, before the interpreter does (a thread still inside torch
            # when it finalizes aborts the process: "terminate called without an active exception")
            if not self._closed:  # (close() may have let go of them already)
                self._parts.close()
        elif isinstance(task.exception(), Exception):  # the loop already failed every waiter with it
            log.error("engine_loop_died", error=repr(task.exception()))

    async def close(self) -> None:
        if self._loop_task is None:
            return
        for seq in list(self.submitter.requests.values()):
            if not seq.finished:
                self.loop.abort(seq)
        self.loop.close()
        try:
            await self._loop_task
        except BaseException:  # noqa: BLE001 - already reported by _loop_ended
            pass
        task, self._loop_task = self._loop_task, None
        try:
            self._release(task)
        finally:
            if self._gc_held:
                self._gc_held = False
                gc_freeze.release()

    def _release(self, task: asyncio.Task) -> None:
        """Let go of the runner, KV cache, weights and graphs: a closed Engine is often still
        referenced (the name `async with` bound), and the next Engine sizes its KV cache from the
        memory this one gave back (docs/cuda.md, "Memory")."""
        self._closed = True
        parts = self._parts
        del self._parts, self.loop  # (start() sets them again)
        self.submitter.unbind()
        device = parts.device
        # a dead loop's error goes on in requests' hands; its frames' locals (the loop, the runner) must not
        errors = [task.exception() if not task.cancelled() else None, parts.loop.error]
        clear_loop_frames(*(e for e in errors if e is not None))
        del task, errors
        try:
            parts.close()
        finally:
            del parts
            device.release_memory()  # after the graphs and every reference: the allocator's cache back

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # --- requests -------------------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            if self._closed:
                raise EngineClosedError("engine is closed (close() ran; start() it again to use it)")
            error = EngineClosedError("engine is not running (use `async with Engine(...)` or `await engine.start()`)")
            died = self._loop_task is not None and self.loop.error
            if died:
                error = EngineClosedError(f"engine is not running: {died}")
                error.__cause__ = died.__cause__ if isinstance(died, EngineClosedError) and died.__cause__ else died
            raise error
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return  # plain synchronous code (the metrics property from a script): reads only
        if running is not self._owner:
            raise WrongEventLoopError("this Engine was started on another event loop; call it from that loop "
                                      "(asyncio.run_coroutine_threadsafe from other threads)")

    # --- LoRA adapters (docs/lora.md; api/lora.py) ---------------------------------------------------

    async def _start_loras(self) -> None:
        from slipstream.models.base import DTYPES
        from slipstream.models.registry import for_spec

        parts = self._parts
        self.submitter.loras.bind(parts.runner, parts.model_config, for_spec(self.config.model).lora,
                                  parts.device.kind, DTYPES[self.config.dtype], self.submitter.lora_slots)
        for name, path in (self.config.lora_adapters or {}).items():
            await self.submitter.loras.load(name, path)

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Load a PEFT LoRA folder under `name` (read off the loop; requests running meanwhile are
        untouched); any number may be loaded, at most max_loras resident at once (docs/lora.md).
        LoraAdapterError (an InvalidRequestError naming the field) when it is refused."""
        self._check_running()
        entry = await self.submitter.loras.load(name, path)
        return {"name": entry.name, "path": entry.path, "rank": entry.rank, "targets": list(entry.targets)}

    async def unload_lora(self, name: str) -> None:
        """New requests can no longer name it (LoraNotFoundError if none is loaded so); running ones finish."""
        self._check_running()
        self.submitter.loras.unload(name)

    def loras(self) -> list[dict[str, Any]]:
        """The loaded adapters: name, path, rank, targets, slot (None: not resident now), bytes."""
        return self.submitter.loras.list()

    @property
    def region_skills(self) -> bool:
        """Whether point/detect run on the model's region heads (Moondream) rather than as text."""
        return self.submitter.region_skills

    @property
    def parts(self):
        """The running engine's EngineParts (api/assemble.py): for tests and tools that look inside
        (None before start and once closed)."""
        return vars(self).get("_parts")

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, *, images: Sequence[ImageLike] = ()
                       ) -> CompletionOutput | list[CompletionOutput]:
        """One CompletionOutput; with params.n > 1, a list of n (slipstream/api/fanout.py). `images` go
        where the prompt's `<image>` markers are, in order (none: the images go first)."""
        return await self._complete(prompt, params, request_id, images, None)

    async def _complete(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                        images: Sequence[ImageLike], fields: Sequence[str] | None) -> CompletionOutput | list[CompletionOutput]:
        if wants_fan_out(params):
            return await fan_out(lambda p, rid: self._complete(prompt, p, rid, images, fields), params, request_id)
        submitter = self.submitter
        seq = await submitter.submit(prompt, params, request_id, streaming=False,  # deltas are not read: none queued
                                     images=images, fields=fields)
        finished = False
        try:
            while True:
                item = await submitter.next(seq)
                if isinstance(item, CompletionOutput):
                    finished = True
                    return item
        finally:
            submitter.forget(seq, finished)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None, *, images: Sequence[ImageLike] = ()) -> DeltaStream:
        """Async iterator of StreamDelta; leaving it early (break, an exception) aborts the request at once."""
        return RequestStream(self.submitter, request_id, params, {"prompt": prompt, "images": images})

    async def chat(self, messages: Messages, params: SamplingParams | None = None,
                   request_id: str | None = None, *, images: Sequence[ImageLike] = (), tools: Tools = None,
                   tool_choice: ToolChoice = None, parallel_tool_calls: bool = True
                   ) -> CompletionOutput | list[CompletionOutput]:
        """`messages` may carry OpenAI image parts ({"type": "image_url", ...} or {"type": "image",
        "image": ...}); `images` fill `<image>` markers written in the messages' text. With `tools`
        the output's `content` and `tool_calls` are filled (docs/tools.md)."""
        messages, found, fields = split_chat_images(messages, images)
        if found:  # before the template sees image parts it may not know
            self._check_running()  # (a closed engine has no image processing left to ask)
            require_vision(self.submitter.image_processing is not None, fields[0])
        plan = make_plan(self.tokenizer, tools, tool_choice, parallel_tool_calls)
        if plan is not None:
            plan, params = plan.params(params)
        # (with images the text: its markers are expanded before it is tokenized)
        prompt = self.submitter.chat_prompt(messages, plan) if found else await self.submitter.chat_ids(messages, plan)
        out = await self._complete(prompt, params, request_id, found, fields)
        if plan is None:
            return out
        return plan.output(cast(CompletionOutput, out))  # (n == 1 with tools: ToolPlan.params refuses more)

    def chat_stream(self, messages: Messages, params: SamplingParams | None = None,
                    request_id: str | None = None, *, images: Sequence[ImageLike] = (), tools: Tools = None,
                    tool_choice: ToolChoice = None, parallel_tool_calls: bool = True) -> DeltaStream:
        return RequestStream(self.submitter, request_id, params, {"messages": messages, "images": images,
                                                                  "tools": (tools, tool_choice, parallel_tool_calls)})

    async def chat_prompt(self, messages: Messages) -> str:
        """The prompt text; image parts become `<image>` markers. chat() and chat_stream() tokenize it
        without the tokenizer's own special tokens, as transformers does; stream() of this text adds
        them (for Gemma or Mistral, a second BOS)."""
        return self.submitter.chat_prompt(split_chat_images(messages)[0])

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its waiter gets finish_reason "abort". False if unknown or finished."""
        self._check_running()
        seq = self.submitter.requests.get(request_id)
        if seq is None or seq.finished:
            return False
        self.loop.abort(seq)
        return True

    async def stats(self) -> dict[str, Any]:
        return self.stats_now()

    def stats_now(self) -> dict[str, Any]:
        """stats() for synchronous callers (the worker's socket callbacks)."""
        self._check_running()
        planner, pipeline, pool = self.loop.planner, self.loop.pipeline, self._parts.pool
        return {
            "kv_pages_free": pool.num_free,
            "kv_pages_total": pool.total,
            "running": sum(not s.finished for s in planner.running),
            "waiting": planner.num_waiting,
            "failed_steps": self.loop.failed_steps,
            "steps": self.loop.num_steps,
            "eager_steps": self._parts.runner.eager_steps,  # launched without a graph (docs/cuda.md)
            "inflight_steps": len(pipeline.inflight),
            "zombie_commits": pipeline.zombie_commits,
            "preemptions": planner.num_preemptions,
            "pipeline_depth": self.config.pipeline_depth,
            **prefix_cache_stats(planner.prefix_cache),
            **encoder_cache_stats(planner.encoder_cache, self._parts.encoder_row_bytes),
            **({"speculative": planner.speculation.stats()} if planner.speculation is not None else {}),
            "lora": self.submitter.loras.stats(),  # adapters loaded, resident, reads, evictions, waits
        }

    # --- observability (slipstream/metrics.py, slipstream/trace.py) ---------------------------

    @property
    def metrics(self):
        """This engine's EngineMetrics; `.registry` is what a /metrics endpoint serves."""
        self._check_running()
        return self._parts.metrics

    async def metrics_text(self) -> str:
        """The Prometheus text exposition of this engine's metrics."""
        return self.metrics.text()

    async def health(self) -> HealthReply:
        """The same answer a worker gives a Client, for this process: never raises; ready is False
        before start, after close, and once the loop died. heartbeat_s and max_message_bytes
        describe a wire and are 0 here; seq is 0."""
        try:
            self._check_running()
            ready = True
        except EngineClosedError:
            ready = False
        return HealthReply(seq=0, ready=ready, draining=False, model=self.config.model, pid=os.getpid(),
                           heartbeat_s=0.0, max_message_bytes=0,
                           chat_template=bool(getattr(self.tokenizer, "chat_template", None)),
                           region_skills=ready and self.region_skills)

    @property
    def tracer(self):
        """The step Tracer with EngineConfig(trace=True), else None."""
        self._check_running()
        return self._parts.tracer


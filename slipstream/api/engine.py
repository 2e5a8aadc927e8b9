"""The public async API in this process: Engine(EngineConfig) implements EngineAPI (interface.py)."""
from __future__ import annotations

import asyncio
import itertools
import os
import random
import secrets
import time
from typing import Any, Self, Sequence

import structlog

from slipstream import gc_freeze
from slipstream import validate as check
from slipstream.errors import (EngineAlreadyStartedError, EngineClosedError, GrammarCompileError, GrammarError,
                               InvalidRequestError, WrongEventLoopError)
from slipstream.intmath import ceil_div
from slipstream.outputs import CompletionOutput, RequestMetrics
from slipstream.params import EngineConfig, SamplingParams
from slipstream.models.byte_stream import byte_table, make_detokenizer
from slipstream.grammar.base import carry_tokens, resolve_carry
from slipstream.grammar.region import REGION_KINDS
from slipstream.runtime.batch import MAX_CARRY_TOKENS, MAX_CARRY_VALUES, SamplingRow
from slipstream.api.interface import DeltaStream, Messages, Prompt
from slipstream.api.fanout import fan_out, wants_fan_out
from slipstream.api.encode import check_prompt_chars, encode_off_loop
from slipstream.api.image_prompt import IMAGE_MARKER, prepare_images_off_loop, split_chat_images
from slipstream.api.output_processor import RequestState
from slipstream.api.protocol import HealthReply
from slipstream.api.request_stream import RequestStream
from slipstream.api.skills import SkillMethods
from slipstream.scheduler.block_hash import salt_key
from slipstream.scheduler.sequence import Sequence as SchedSeq
from slipstream.images import ImageLike, check_image_count, require_vision

log = structlog.get_logger(__name__)


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
    def __init__(self, config: EngineConfig | None = None, **overrides):
        if config is not None and not isinstance(config, EngineConfig):
            raise InvalidRequestError(f"config must be an EngineConfig, got {type(config).__name__} (keywords: "
                                      "Engine(model=...) or Engine(EngineConfig(...)))", param="config")
        self.config = config or EngineConfig(**overrides)
        self._loop_task: asyncio.Task | None = None
        self._requests: dict[str, SchedSeq] = {}
        self._ids = itertools.count()
        self._id_prefix = f"req-{secrets.token_hex(4)}-"  # auto ids never look like a user's "req-1"
        self._owner: asyncio.AbstractEventLoop | None = None
        self._rng = random.Random(self.config.seed)
        self.tokenizer = None
        self._gc_held = False  # gc_freeze.hold() called, release() not yet

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> Self:
        from slipstream.api.assemble import assemble  # torch-heavy imports happen at start

        if not isinstance(self.config, EngineConfig):
            raise InvalidRequestError(f"config must be an EngineConfig, got {type(self.config).__name__}",
                                      param="config")
        if self._loop_task is not None:
            raise EngineAlreadyStartedError("engine already started: close() it before starting it again")
        self._owner = asyncio.get_running_loop()
        # before the parts exist: only the libraries and what the application had are frozen, never
        # an engine (gc_freeze.py); counted for every engine, so none freezes while another runs
        gc_freeze.hold(self.config.freeze_gc)
        self._gc_held = True
        self._parts = None
        try:
            self._parts = await asyncio.to_thread(assemble, self.config)
            self.tokenizer, self.model_config = self._parts.tokenizer, self._parts.model_config
            await asyncio.to_thread(byte_table, self.tokenizer)  # built once here, not on the first request
            self.loop = self._parts.loop
            self.max_model_len = self._parts.max_model_len
            self._image_processing = self._parts.image_processing  # None: a text-only model
            from slipstream.grammar.compiler import GrammarCompiler

            from slipstream.grammar.region import region_factories

            region = getattr(self._image_processing, "region_tokens", None)  # Moondream: point/detect
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                             timeout_s=self.config.grammar_timeout_s,
                                             factories=region_factories(*region) if region else None)
            self._loop_task = asyncio.create_task(self._run_loop(), name="slipstream-engine-loop")
        except BaseException:  # a failed start leaves no device threads and no gc hold behind
            if self._parts is not None:
                self._parts.close()
            self._gc_held = False
            gc_freeze.release()
            raise
        log.info("engine_started", model=self.config.model, device=self.config.device,
                 pipeline_depth=self.config.pipeline_depth, kv_pages=self._parts.pool.total)
        return self

    async def _run_loop(self) -> None:
        try:
            await self.loop.run()
        except asyncio.CancelledError:
            # cancelled, not closed: asyncio.run() tearing down after the application raised. The
            # device's threads stop now, before the interpreter does (a thread still inside torch
            # when it finalizes aborts the process: "terminate called without an active exception")
            self._parts.close()
            raise
        except Exception as e:  # the loop already failed every waiter with it
            log.error("engine_loop_died", error=repr(e))
            raise

    async def close(self) -> None:
        if self._loop_task is None:
            return
        for seq in list(self._requests.values()):
            if not seq.finished:
                self.loop.abort(seq)
        self.loop.close()
        try:
            await self._loop_task
        except BaseException:  # noqa: BLE001 - already reported by _run_loop
            pass
        self._loop_task = None
        try:
            self._parts.close()
        finally:
            if self._gc_held:
                self._gc_held = False
                gc_freeze.release()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # --- requests -------------------------------------------------------------------------------

    def _check_running(self) -> None:
        if self._loop_task is None or self._loop_task.done():
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

    async def _submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                      streaming: bool = True, images: Sequence[ImageLike] = (), fields: Sequence[str] | None = None) -> SchedSeq:
        self._check_running()
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}",
                                      param="params")
        params.check()  # again: a value forced in after construction never reaches the tick
        if params.n > 1:  # complete/chat fan out before this; a stream cannot (slipstream/api/fanout.py)
            raise InvalidRequestError("n > 1 cannot be streamed; use complete() or chat()", param="n")
        request_id = check.request_id(request_id)
        spec = params.grammar_spec()
        skill = self._region_skill(spec, prompt, images)
        ids, spans = await self._prompt_ids(prompt, images, fields, skill)
        bidirectional = self._bidirectional_len(spans)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                                      f"exceeds the model context of {self.max_model_len} tokens; lower max_tokens "
                                      f"to at most {self.max_model_len - len(ids)}", param="max_tokens")
        # compiled off the tick (a thread, under a timeout); a bad grammar fails only this call
        try:
            grammar = await self._grammars.compile_async(spec) if spec is not None else None
            matcher = grammar.matcher() if grammar is not None else None
            carry = self._carry_of(grammar, spec.kind) if grammar is not None else ()
        except GrammarError as e:
            e.param = params.grammar_field()
            raise
        except RecursionError:  # a schema nested deeper than the compiler's recursion
            raise InvalidRequestError(f"{params.grammar_field()} is nested too deeply to compile",
                                      param=params.grammar_field()) from None
        if request_id is None:
            request_id = f"{self._id_prefix}{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use", param="request_id")
        max_tokens = params.max_tokens
        pool, page = self._parts.pool, self.config.page_size
        if ceil_div(len(ids) + max_tokens, page) > pool.total:
            raise InvalidRequestError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) needs more KV pages "
                                      f"than the whole pool holds ({pool.total} pages of {page})", param="max_tokens")
        eos = () if params.ignore_eos else tuple(self.tokenizer.eos_token_ids)
        seed = params.seed if params.seed is not None else self._rng.randrange(2**31)
        row = SamplingRow(temperature=float(params.temperature), top_k=max(params.top_k, 0), top_p=params.top_p,
                          seed=seed, logprobs=params.logprobs or params.top_logprobs > 0,
                          presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                          repetition_penalty=params.repetition_penalty, min_p=params.min_p,
                          min_tokens=params.min_tokens, top_logprobs=params.top_logprobs,
                          stop_ids=tuple(sorted(frozenset(eos) | frozenset(params.stop_token_ids))), carry=carry)
        req = RequestState(request_id, ids, params, make_detokenizer(self.tokenizer, ids),
                           frozenset(eos) | frozenset(params.stop_token_ids), RequestMetrics(time.perf_counter()),
                           matcher=matcher, streaming=streaming)
        # without stop strings, the tick ends it at the grammar's completion (output_processor.accept)
        seq = SchedSeq(request_id, ids, max_tokens, row, user=req, matcher=matcher, ends_with_grammar=not params.stop,
                       images=spans,
                       bidirectional_len=bidirectional,
                       cache_extra=salt_key(params.cache_salt) if params.prefix_caching else None)
        self._requests[request_id] = seq
        self.loop.submit(seq)
        return seq

    def _carry_of(self, grammar, kind: str) -> tuple[tuple[int, int], ...]:
        """The grammar's carry tokens as (token id, the model's carry kind); GrammarCompileError when
        the model lacks a head it names (docs/moondream.md, "The carry")."""
        declared = carry_tokens(grammar, f"grammar {kind!r}")
        if not declared:
            return ()
        model_kinds = self._parts.runner.carry_kinds
        wide = [k.name for k in model_kinds if k.values > MAX_CARRY_VALUES]
        if wide:
            raise GrammarCompileError(f"the model's carry kinds {wide} have more than {MAX_CARRY_VALUES} values")
        return resolve_carry(declared, model_kinds, MAX_CARRY_TOKENS, f"grammar {kind!r}")

    @property
    def region_skills(self) -> bool:
        """Whether point/detect run on the model's region heads (Moondream) rather than as text."""
        return self._grammars.factories.keys() >= set(REGION_KINDS)

    def _region_skill(self, spec, prompt: Prompt, images) -> tuple[str, str] | None:
        """(kind, object) when this request is a region skill: its prompt is the model's template for
        the object (docs/moondream.md, "point and detect"), so the prompt text must be empty."""
        if spec is None or spec.kind not in REGION_KINDS or spec.kind not in self._grammars.factories:
            return None
        if not images:
            raise InvalidRequestError(f"images: {spec.kind} on this model looks at one image; none was given",
                                      param="images")
        text = prompt.replace(IMAGE_MARKER, "", 1) if isinstance(prompt, str) else prompt
        if not isinstance(text, str) or text.strip():
            raise InvalidRequestError(f"prompt: {spec.kind} on this model has a fixed template holding only the "
                                      "object name; pass an empty prompt", param="prompt")
        if not spec.value.strip():
            raise InvalidRequestError(f"object: {spec.kind} needs an object name", param="object")
        return spec.kind, spec.value

    def _bidirectional_len(self, spans: list) -> int:
        """The prompt's leading positions that attend both ways (Moondream's BOS + image): computed in
        one chunk (scheduler/chunking.py), so a step must hold them all."""
        measure = getattr(self._image_processing, "bidirectional_len", None)
        n = measure(spans) if measure is not None else 0
        if n > self.config.max_num_batched_tokens:
            raise InvalidRequestError(f"images: this model computes its image prefix of {n} tokens in one step, more "
                                      f"than max_num_batched_tokens={self.config.max_num_batched_tokens}; start the "
                                      f"engine with max_num_batched_tokens >= {n} (--max-num-batched-tokens)",
                                      param="images")
        return n

    async def _prompt_ids(self, prompt: Prompt, images: Sequence[ImageLike] = (), fields: Sequence[str] | None = None,
                          skill: tuple[str, str] | None = None):
        """(token ids, image spans) of a prompt; images are loaded, preprocessed and the prompt expanded
        and tokenised off the loop (api/image_prompt.py)."""
        if skill is None:  # (a region skill's prompt was checked to be empty: the template replaces it)
            prompt = check.prompt(prompt, self.model_config.vocab_size)
        if isinstance(images, (str, bytes)) or not isinstance(images, (list, tuple)):
            images = [images]  # one image given bare
        images = list(images)
        fields = list(fields) if fields is not None else [f"images[{i}]" for i in range(len(images))]
        image_token = self.model_config.image_token_id
        spans: list = []
        if images:
            require_vision(self._image_processing is not None, fields[0])
            check_image_count(len(images), "images")
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt: a request with images needs a text prompt (its <image> markers "
                                          "are expanded before tokenising)", param="prompt")
            check_prompt_chars(prompt, self.config.max_prompt_chars)
            ids, spans = await prepare_images_off_loop(prompt, images, fields, self._image_processing,
                                                       self.tokenizer, image_token, skill)
        elif isinstance(prompt, str):
            ids = await encode_off_loop(self.tokenizer, prompt, self.config.max_prompt_chars)
        else:
            ids = list(prompt)
        if not images and image_token is not None and image_token in ids:
            raise InvalidRequestError("prompt: it holds image placeholder tokens but no images were given",
                                      param="prompt")
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the model context is {self.max_model_len}",
                                      param="prompt")
        return ids, spans

    async def _next(self, seq: SchedSeq):
        item = await seq.user.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _forget(self, seq: SchedSeq, finished: bool) -> None:
        if not finished and not seq.finished:
            self.loop.abort(seq)  # the caller went away (cancelled): free its pages
        if self._requests.get(seq.request_id) is seq:
            del self._requests[seq.request_id]

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
        seq = await self._submit(prompt, params, request_id, streaming=False,  # deltas are not read: none queued
                                 images=images, fields=fields)
        finished = False
        try:
            while True:
                item = await self._next(seq)
                if isinstance(item, CompletionOutput):
                    finished = True
                    return item
        finally:
            self._forget(seq, finished)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               request_id: str | None = None, *, images: Sequence[ImageLike] = ()) -> DeltaStream:
        """Async iterator of StreamDelta; leaving it early (break, an exception) aborts the request at once."""
        return RequestStream(self, request_id, params, {"prompt": prompt, "images": images})

    async def chat(self, messages: Messages, params: SamplingParams | None = None,
                   request_id: str | None = None, *, images: Sequence[ImageLike] = ()
                   ) -> CompletionOutput | list[CompletionOutput]:
        """`messages` may carry OpenAI image parts ({"type": "image_url", ...} or {"type": "image",
        "image": ...}); `images` fill `<image>` markers written in the messages' text."""
        messages, found, fields = split_chat_images(messages, images)
        if found:  # before the template sees image parts it may not know
            require_vision(self._image_processing is not None, fields[0])
        return await self._complete(self._chat_prompt(messages), params, request_id, found, fields)

    def chat_stream(self, messages: Messages, params: SamplingParams | None = None,
                    request_id: str | None = None, *, images: Sequence[ImageLike] = ()) -> DeltaStream:
        return RequestStream(self, request_id, params, {"messages": messages, "images": images})

    async def chat_prompt(self, messages: Messages) -> str:
        """The prompt text; image parts become `<image>` markers."""
        return self._chat_prompt(split_chat_images(messages)[0])

    def _chat_prompt(self, messages: Messages) -> str:
        messages = check.messages(messages)
        self._check_running()
        chars = sum(len(m["content"]) if isinstance(m["content"], str) else  # capped before the template renders them
                    sum(len(p.get("text", "")) for p in m["content"]) for m in messages)
        if chars > self.config.max_prompt_chars:
            raise InvalidRequestError(f"messages have {chars:,} characters of content; this engine takes at most "
                                      f"{self.config.max_prompt_chars:,} (EngineConfig.max_prompt_chars)",
                                      param="messages")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template rejects what the caller sent
            raise InvalidRequestError(f"messages: the chat template failed on them: {e}") from e

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its waiter gets finish_reason "abort". False if unknown or finished."""
        self._check_running()
        seq = self._requests.get(request_id)
        if seq is None or seq.finished:
            return False
        self.loop.abort(seq)
        return True

    async def stats(self) -> dict[str, Any]:
        return self._stats()

    def _stats(self) -> dict[str, Any]:
        """stats() for synchronous callers inside the package (the worker's socket callbacks)."""
        self._check_running()
        planner, pipeline, pool = self.loop.planner, self.loop.pipeline, self._parts.pool
        return {
            "kv_pages_free": pool.num_free,
            "kv_pages_total": pool.total,
            "running": sum(not s.finished for s in planner.running),
            "waiting": planner.num_waiting,
            "failed_steps": self.loop.failed_steps,
            "steps": self.loop.num_steps,
            "inflight_steps": len(pipeline.inflight),
            "zombie_commits": pipeline.zombie_commits,
            "preemptions": planner.num_preemptions,
            "pipeline_depth": self.config.pipeline_depth,
            **prefix_cache_stats(planner.prefix_cache),
            **encoder_cache_stats(planner.encoder_cache, self._parts.encoder_row_bytes),
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


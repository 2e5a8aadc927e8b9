"""A request's way into the Engine: checks, prompt preparation, grammar, and submission to the loop.

The Engine (slipstream/api/engine.py: the lifecycle and the public methods) holds one `Submitter`,
built with the engine and bound to the engine's parts at start; a RequestStream submits through it
too. `submit` turns a prompt and its SamplingParams into a scheduler `Sequence` with its
`RequestState` and hands it to the engine loop. On the way: the prompt's token ids and image spans,
loaded, expanded and tokenised off the loop (`_prompt_ids`, api/image_prompt.py); a region skill's
fixed template (`_region_skill`, docs/moondream.md); the image prefix that must fit one step
(`_bidirectional_len`); the grammar's carry tokens resolved against the model's heads (`_carry_of`).
Every check names the field it failed on. The Submitter also holds the table of live requests.
"""
from __future__ import annotations

import itertools
import random
import secrets
import time
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

from slipstream import validate as check
from slipstream.errors import EngineClosedError, GrammarCompileError, GrammarError, InvalidRequestError
from slipstream.intmath import ceil_div
from slipstream.outputs import RequestMetrics
from slipstream.params import EngineConfig, SamplingParams
from slipstream.models.tokenizers.byte_stream import make_detokenizer
from slipstream.grammar.base import carry_tokens, resolve_carry
from slipstream.grammar.region import REGION_KINDS
from slipstream.runtime.batch import MAX_CARRY_TOKENS, MAX_CARRY_VALUES, SamplingRow
from slipstream.api.interface import Messages, Prompt
from slipstream.api.encode import check_prompt_chars, encode_off_loop
from slipstream.api.image_prompt import IMAGE_MARKER, prepare_images_off_loop
from slipstream.api.lora import LoraRegistry
from slipstream.api.request_stream import RequestState
from slipstream.scheduler.block_hash import image_key, lora_key, salt_key
from slipstream.scheduler.sequence import ImageState, PrefixState, Sequence as SchedSeq
from slipstream.images import ImageLike, check_image_fields, require_vision
from slipstream.tool_calls.plan import ToolPlan, has_tool_messages, tool_prompt

if TYPE_CHECKING:
    from slipstream.api.assemble import EngineParts
    from slipstream.grammar.compiler import GrammarCompiler


class Submitter:
    """The Engine's request submission and its table of live requests (`requests`, by id)."""

    def __init__(self, config: EngineConfig, check_running: Callable[[], None]):
        self.config = config
        # the Engine's check (raises unless it runs, on its own event loop), held weakly: the engine
        # holds its submitter, and a cycle between the two, frozen by gc_freeze with the engine
        # (built before its start), would keep a closed engine alive (tests/test_gc_freeze.py)
        self._check = weakref.WeakMethod(check_running)
        self.requests: dict[str, SchedSeq] = {}
        self._ids = itertools.count()
        self._id_prefix = f"req-{secrets.token_hex(4)}-"  # auto ids never look like a user's "req-1"
        self._rng = random.Random(config.seed)
        self.tokenizer: Any = None
        self.loras = LoraRegistry(config)  # the LoRA adapters a request may name (api/lora.py)

    def lora_slots(self) -> set[int]:
        """The LoRA slots live requests (running or waiting) hold: never evicted (api/lora.py)."""
        return {seq.sampling.lora for seq in self.requests.values() if seq.sampling.lora}

    def check_running(self) -> None:
        check = self._check()
        if check is None:
            raise EngineClosedError("the engine is gone")
        check()

    def bind(self, config: EngineConfig, parts: EngineParts, grammars: GrammarCompiler) -> None:
        """The parts Engine.start() built (and the config it started with)."""
        self.config, self._parts, self.grammars = config, parts, grammars
        self.loop, self.tokenizer, self.model_config = parts.loop, parts.tokenizer, parts.model_config
        self.max_model_len = parts.max_model_len
        self.image_processing = parts.image_processing  # None: a text-only model

    def unbind(self) -> None:
        """The engine closed: nothing here holds its parts (the image processing holds the model)."""
        del self._parts, self.loop  # (bind sets them again)
        self.image_processing = None
        self.loras.unbind()

    async def submit(self, prompt: Prompt, params: SamplingParams | None, request_id: str | None,
                     streaming: bool = True, images: Sequence[ImageLike] = (), fields: Sequence[str] | None = None) -> SchedSeq:
        self.check_running()
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}",
                                      param="params")
        params.check()  # again: a value forced in after construction never reaches the tick
        if params.n > 1:  # complete/chat fan out before this; a stream cannot (slipstream/api/fanout.py)
            raise InvalidRequestError("n > 1 cannot be streamed; use complete() or chat()", param="n")
        request_id = check.request_id(request_id)
        if params.lora is not None:
            self.loras.resolve(params.lora)  # an unknown adapter fails before the prompt's work
        spec = params.grammar_spec()
        skill = self._region_skill(spec, prompt, images)
        ids, spans = await self._prompt_ids(prompt, images, fields, skill)
        if spans and params.cache_salt is not None:  # its images are keyed by the salt too (block_hash.image_key)
            spans = [replace(s, digest=image_key(s.digest, params.cache_salt)) for s in spans]
        bidirectional = self._bidirectional_len(spans)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(f"max_tokens: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                                      f"exceeds the model context of {self.max_model_len} tokens; lower max_tokens "
                                      f"to at most {self.max_model_len - len(ids)}", param="max_tokens")
        # compiled off the tick (a thread, under a timeout); a bad grammar fails only this call
        try:
            grammar = await self.grammars.compile_async(spec) if spec is not None else None
            matcher = grammar.matcher() if grammar is not None else None
            carry = self._carry_of(grammar, spec.kind) if grammar is not None and spec is not None else ()
        except GrammarError as e:
            e.param = params.grammar_field()
            raise
        except RecursionError:  # a schema nested deeper than the compiler's recursion
            raise InvalidRequestError(f"{params.grammar_field()} is nested too deeply to compile",
                                      param=params.grammar_field()) from None
        # the adapter's slot, read into one if it has none (waiting while every slot is busy); held
        # from here by the live request (no await until it is in self.requests)
        lora, lora_slot = await self.loras.acquire(params.lora) if params.lora is not None else (None, 0)
        if request_id is None:
            request_id = f"{self._id_prefix}{next(self._ids)}"
        if request_id in self.requests:
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
                          stop_ids=tuple(sorted(frozenset(eos) | frozenset(params.stop_token_ids or ()))), carry=carry,
                          lora=lora_slot)
        req = RequestState(request_id, ids, params, make_detokenizer(self.tokenizer, ids),
                           frozenset(eos) | frozenset(params.stop_token_ids or ()), RequestMetrics(time.perf_counter()),
                           matcher=matcher, streaming=streaming)
        # without stop strings, the tick ends it at the grammar's completion (output_processor.accept)
        seq = SchedSeq(request_id, ids, max_tokens, row, user=req, matcher=matcher, ends_with_grammar=not params.stop,
                       images=ImageState(spans) if spans else None,
                       bidirectional_len=bidirectional,
                       prefix=PrefixState(lora_key(None if lora is None else lora.key) + salt_key(params.cache_salt)
                                          if params.prefix_caching else None),
                       speculate=params.speculative)
        self.requests[request_id] = seq
        self.loop.submit(seq)
        return seq

    async def next(self, seq: SchedSeq):
        """The request's next item: a delta or its CompletionOutput; its error is raised."""
        item = await seq.user.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def forget(self, seq: SchedSeq, finished: bool) -> None:
        """The caller is done with the request: aborted if it still runs (the caller went away), its
        id free again."""
        if not finished and not seq.finished and "loop" in vars(self):  # (closed: the engine aborted it)
            self.loop.abort(seq)  # (cancelled: free its pages)
        if self.requests.get(seq.request_id) is seq:
            del self.requests[seq.request_id]
            if seq.sampling.lora:  # its adapter's slot may be idle now (api/lora.py)
                self.loras.release(seq.sampling.lora)

    def chat_prompt(self, messages: Messages, plan: ToolPlan | None = None) -> str:
        """The prompt text of checked messages: the tools' prompt with a plan or tool messages, else
        the tokenizer's chat template."""
        messages = check.messages(messages)
        self.check_running()
        chars = sum(len(m["content"]) if isinstance(m["content"], str) else  # capped before the template renders them
                    sum(len(p.get("text", "")) for p in m["content"]) for m in messages)
        if chars > self.config.max_prompt_chars:
            raise InvalidRequestError(f"messages have {chars:,} characters of content; this engine takes at most "
                                      f"{self.config.max_prompt_chars:,} (EngineConfig.max_prompt_chars)",
                                      param="messages")
        if plan is not None or has_tool_messages(messages):
            return tool_prompt(self.tokenizer, messages, plan)
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template rejects what the caller sent
            raise InvalidRequestError(f"messages: the chat template failed on them: {e}") from e

    async def chat_ids(self, messages: Messages, plan: ToolPlan | None = None) -> list[int]:
        """The prompt ids of checked messages: chat_prompt's text tokenized as a chat template's
        (encode_off_loop's `chat`: no second BOS)."""
        return await encode_off_loop(self.tokenizer, self.chat_prompt(messages, plan), self.config.max_prompt_chars,
                                     "messages", chat=True)

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
        return self.grammars.factories.keys() >= set(REGION_KINDS)

    def _region_skill(self, spec, prompt: Prompt, images) -> tuple[str, str] | None:
        """(kind, object) when this request is a region skill: its prompt is the model's template for
        the object (docs/moondream.md, "point and detect"), so the prompt text must be empty."""
        if spec is None or spec.kind not in REGION_KINDS or spec.kind not in self.grammars.factories:
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
        one chunk (scheduler/chunking.py), so a step must hold them all beside a full batch of decode
        rows (planned first, one token each): with less, a prefix waits until a decoding request ends,
        without bound under steady traffic. Refused here rather than starved."""
        measure = getattr(self.image_processing, "bidirectional_len", None)
        n = measure(spans) if measure is not None else 0
        budget, others = self.config.max_num_batched_tokens, self.config.max_batch_size - 1
        if n and n + others > budget:
            raise InvalidRequestError(f"images: this model computes its image prefix of {n} tokens in one step, beside "
                                      f"up to {others} decoding requests (max_batch_size={others + 1}), more than "
                                      f"max_num_batched_tokens={budget}; start the engine with max_num_batched_tokens "
                                      f">= {n + others} (--max-num-batched-tokens) or a smaller max_batch_size",
                                      param="images")
        return n

    async def _prompt_ids(self, prompt: Prompt, images: Sequence[ImageLike] = (), fields: Sequence[str] | None = None,
                          skill: tuple[str, str] | None = None):
        """(token ids, image spans) of a prompt; images are loaded, preprocessed and the prompt expanded
        and tokenised off the loop (api/image_prompt.py)."""
        if skill is None:  # (a region skill's prompt was checked to be empty: the template replaces it)
            prompt = check.prompt(prompt, self.model_config.vocab_size)
        if isinstance(images, (str, bytes)) or not isinstance(images, (list, tuple)):
            images = [cast(ImageLike, images)]  # one image given bare
        images = list(images)
        fields = list(fields) if fields is not None else [f"images[{i}]" for i in range(len(images))]
        image_token = self.model_config.image_token_id
        spans: list = []
        if images:  # the count first, as every door (issue 37: `images` here, `images[8]` elsewhere)
            check_image_fields(fields)
            require_vision(self.image_processing is not None, fields[0])
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt: a request with images needs a text prompt (its <image> markers "
                                          "are expanded before tokenising)", param="prompt")
            check_prompt_chars(prompt, self.config.max_prompt_chars)
            ids, spans = await prepare_images_off_loop(prompt, images, fields, self.image_processing,
                                                       self.tokenizer, image_token, skill,
                                                       pin=self.config.device == "cuda")
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

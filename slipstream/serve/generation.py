"""POST /v1/completions and /v1/chat/completions: body → prompt ids + params → backend → JSON or SSE."""
from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from slipstream.api.fanout import fan_out, wants_fan_out
from slipstream.api.interface import DeltaStream
from slipstream.api.encode import encode_off_loop
from slipstream.errors import InvalidRequestError, SlipstreamError
from slipstream.serve import chat_tools, render, sse
from slipstream.serve.api_errors import ApiError, from_decode_error, from_slipstream, invalid
from slipstream.serve.body import read_body
from slipstream.serve.images import request_images
from slipstream.serve.lora import lora_of
from slipstream.serve.openai_types import IMAGE_MARKER, ChatCompletionRequest, CompletionRequest, image_parts
from slipstream.serve.sampling import sampling_params
from slipstream.serve.state import ServerState, new_request_id, now_s

log = structlog.get_logger(__name__)
_DECODERS: dict[bool, msgspec.json.Decoder[Any]] = {False: msgspec.json.Decoder(CompletionRequest), True: msgspec.json.Decoder(ChatCompletionRequest)}
_encode = msgspec.json.Encoder().encode
_POLL_S = 0.2  # how often a request waiting on the engine checks that its client is still there


class ClientGone(Exception):
    """The HTTP client disconnected while its request waited on the engine."""


def decode_body(raw: bytes, chat: bool):
    return decode_json(_DECODERS[chat].decode, raw)


def decode_json(decode, raw: bytes):
    """`decode(raw)`, every way it can fail on what a client sent a 400 in OpenAI's shape."""
    try:
        return decode(raw)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None
    except UnicodeDecodeError as e:  # msgspec: invalid UTF-8 inside a JSON string
        raise invalid(f"request body is not valid UTF-8 ({e.reason} at byte {e.start})", None,
                      "invalid_body") from None
    except RecursionError:
        raise invalid("request body is nested too deeply", None, "invalid_body") from None


def check_chat_chars(state: ServerState, messages) -> None:
    chars = sum(len(m.text()) for m in messages)
    if chars > state.max_prompt_chars:
        raise invalid(f"messages have {chars:,} characters of content; this server takes at most "
                      f"{state.max_prompt_chars:,}", "messages", "prompt_too_long")


def chat_text(tokenizer, messages, add_generation_prompt: bool = True, plan=None) -> str:
    """The model's chat template over the messages; a template that refuses them (roles out of order,
    a role it does not know) is the request's fault: 400 naming `messages`. With tools (`plan`) or calls
    and results in the history: the tool format's rendering (serve/chat_tools.py)."""
    if chat_tools.uses_tools(messages, plan):
        return chat_tools.prompt_text(tokenizer, messages, plan, add_generation_prompt)
    parts = [{"role": m.role, "content": m.template_content()} for m in messages]
    n_images = len(image_parts(messages))
    try:
        text = tokenizer.apply_chat_template(parts, add_generation_prompt=add_generation_prompt)
        if n_images and text.count(IMAGE_MARKER) != n_images:
            # a template that knows only text content: the text with a marker where each image stood
            plain = [{"role": m.role, "content": m.text()} for m in messages]
            text = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
        return text
    except Exception as e:  # noqa: BLE001 - jinja templates raise whatever they like
        raise invalid(f"the chat template failed on these messages: {e}", "messages") from None


async def prompt_ids(state: ServerState, req: CompletionRequest | ChatCompletionRequest,
                     plan=None) -> tuple[list[int], str]:
    """Token ids of the prompt (chat template applied, with the tools of `plan`), and the field to blame
    for a bad prompt. Its size is checked first; a long one is tokenized off the event loop
    (slipstream/api/encode.py)."""
    b = state.backend
    if isinstance(req, ChatCompletionRequest):
        check_chat_chars(state, req.messages)
        text = chat_text(b.tokenizer, req.messages, plan=plan)
        ids, field = await _encode_text(state, text, "messages", chat=True), "messages"
    elif isinstance(req.prompt, str):
        ids, field = await _encode_text(state, req.prompt, "prompt"), "prompt"
    else:
        ids, field = list(req.prompt), "prompt"
        if max(ids) >= b.vocab_size:
            raise invalid(f"prompt token ids must be below the vocabulary size {b.vocab_size}", field)
    if not ids:
        raise invalid("the prompt encodes to no tokens", field)
    if b.max_model_len is not None and len(ids) >= b.max_model_len:
        raise invalid(f"the prompt has {len(ids)} tokens; the model context is {b.max_model_len}", field,
                      "context_length_exceeded")
    return ids, field


async def _encode_text(state: ServerState, text: str, field: str, chat: bool = False) -> list[int]:
    try:
        return await encode_off_loop(state.backend.tokenizer, text, state.max_prompt_chars, field, chat=chat)
    except InvalidRequestError as e:
        raise invalid(str(e), field, "prompt_too_long") from None


async def until_disconnect(request: Request, awaitable) -> Any:
    """Await `awaitable`; if the client goes away first, cancel it (its request is aborted) and raise ClientGone."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def handle(state: ServerState, request: Request, chat: bool) -> Response:
    t0 = time.perf_counter()
    rid = new_request_id("chatcmpl" if chat else "cmpl", request.headers.get("x-request-id"))
    req = decode_body(await read_body(request, state.max_body_bytes), chat)
    # completions' logprobs: 0 asks for the sampled tokens' logprobs (as OpenAI): refused like >= 1
    if req.stream and (req.logprobs if chat else req.logprobs is not None):
        raise invalid("logprobs are not available on streamed responses yet; use stream=false", "logprobs")
    want_logprobs = bool(req.logprobs) or (not chat and req.logprobs == 0)
    return await generate(state, request, req, rid, t0, ChatStyle(chat, want_logprobs))


async def generate(state: ServerState, request: Request, req: CompletionRequest | ChatCompletionRequest, rid: str,
                   t0: float, style, tools: tuple | None = None) -> Response:
    """Run one decoded request and answer it in `style` (ChatStyle here; serve/responses.py's for
    /v1/responses, which passes its `tools` (tools, tool_choice, parallel_tool_calls) apart)."""
    chat, endpoint = isinstance(req, ChatCompletionRequest), style.endpoint
    if req.stream and req.n > 1:
        raise invalid("n > 1 is not available on streamed responses; use stream=false", "n")
    if tools is None and isinstance(req, ChatCompletionRequest):
        tools = (req.tools, req.tool_choice, req.parallel_tool_calls)
    plan = chat_tools.plan_of(state.backend.tokenizer, *tools) if tools is not None else None
    images = await _images(state, req) if isinstance(req, ChatCompletionRequest) else []
    ids, _ = await prompt_ids(state, req, plan)
    params, grammar_param = sampling_params(req, style.logprobs, len(ids), state.backend.max_model_len)
    adapter = lora_of(state.backend, req.model)  # the request's `model` may name a LoRA adapter
    if adapter is not None:
        params = msgspec.structs.replace(params, lora=adapter)
    if plan is not None:
        plan, params, grammar_param = chat_tools.constrain(plan, params, grammar_param)
    parser = plan.parser() if plan is not None else None
    # with images the engine gets the text: it expands each <image> marker into the image's tokens
    prompt = (chat_text(state.backend.tokenizer, cast(ChatCompletionRequest, req).messages, plan=plan) if images
              else ids)  # (images come only with a chat request)
    images_kw = {"images": images} if images else {}
    model = adapter or state.backend.model_name
    state.admit()
    released = False
    try:
        created = now_s()
        if req.stream:
            deltas = state.backend.stream(prompt, params, rid, **images_kw)
            first = await _first(request, deltas, grammar_param)
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = style.events(rid, created, model, len(ids), include_usage, parser)
            body = _stream_body(state, rid, len(ids), first, deltas, events, t0, endpoint)
            released = True  # the body releases it when the stream ends
            return StreamingResponse(body, media_type="text/event-stream",
                                     headers={"x-request-id": rid, "cache-control": "no-cache"})
        try:
            outs = await until_disconnect(request, _complete(state, prompt, params, rid, images_kw))
        except SlipstreamError as e:
            raise from_slipstream(e, grammar_param) from None
        if plan is not None:
            outs = [plan.output(o) for o in outs]
        body = style.body(state.backend.tokenizer, rid, created, model, outs)
        _done(state, rid, endpoint, 200, t0, len(ids), sum(o.usage.completion_tokens for o in outs),
              outs[0].finish_reason)
        return Response(_encode(body), media_type="application/json", headers={"x-request-id": rid})
    except ClientGone:
        _done(state, rid, endpoint, 499, t0, len(ids), 0, "abort")
        return Response(status_code=499)
    finally:
        if not released:
            state.release()


class ChatStyle:
    """The answers of /v1/completions and /v1/chat/completions: a JSON body, or SSE chunks then [DONE]."""

    def __init__(self, chat: bool, logprobs: bool) -> None:
        self.chat, self.logprobs = chat, logprobs
        self.endpoint = "chat" if chat else "completions"

    def body(self, tok, rid: str, created: int, model: str, outs: list) -> dict:
        if self.chat:
            lps = [render.chat_logprobs(tok, o) if self.logprobs else None for o in outs]
            return render.chat(rid, created, model, outs, lps)
        lps = [render.completion_logprobs(tok, o) if self.logprobs else None for o in outs]
        return render.completion(rid, created, model, outs, lps)

    def events(self, rid: str, created: int, model: str, prompt_tokens: int, include_usage: bool, parser):
        return ChatChunks(rid, created, model, self.chat, prompt_tokens, include_usage,
                          chat_tools.ToolChunks(parser) if parser is not None else None)


class ChatChunks:
    """The SSE events of one chat or completion stream (what `_stream_body` sends, in order)."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, prompt_tokens: int, include_usage: bool,
                 tools: chat_tools.ToolChunks | None) -> None:
        self.head = (rid, created, model)
        self.chat, self.prompt_tokens, self.include_usage, self.tools = chat, prompt_tokens, include_usage, tools

    def start(self) -> list[bytes]:
        if not self.chat:
            return []
        return [sse.event(render.chat_chunk(*self.head, {"role": "assistant", "content": ""}, None))]

    def delta(self, delta) -> list[bytes]:
        finish = delta.finish_reason
        if self.tools is not None:
            body = self.tools.delta(delta.text, finish is not None)
            finish = self.tools.finish(finish) if finish is not None else None
            if body is None and finish is None:
                return []
            return [sse.event(render.chat_chunk(*self.head, body or {}, finish))]
        if not delta.text and finish is None:
            return []
        if self.chat:
            return [sse.event(render.chat_chunk(*self.head, {"content": delta.text}, finish))]
        return [sse.event(render.completion_chunk(*self.head, delta.text, finish))]

    def end(self, n_out: int, cached: int) -> list[bytes]:
        usage = [sse.event(render.usage_chunk(*self.head, self.chat, self.prompt_tokens, n_out, cached))]
        return (usage if self.include_usage else []) + [sse.DONE]

    def error(self, err: ApiError) -> list[bytes]:
        return [sse.event(err.body()), sse.DONE]


async def _images(state: ServerState, req: ChatCompletionRequest) -> list:
    """The request's images, fetched, decoded and validated (slipstream/serve/images.py); 400 naming the part."""
    try:
        return await request_images(image_parts(req.messages), state.images,
                                    bool(getattr(state.backend, "accepts_images", False)), state.max_body_bytes)
    except InvalidRequestError as e:
        raise invalid(str(e), e.param, "invalid_image") from None


async def _complete(state: ServerState, prompt, params, rid: str, images_kw: dict) -> list:
    """The request's completions, one per choice: n > 1 fans out here, so every backend sees n=1
    (children are `{rid}-{i}`, slipstream/api/fanout.py)."""
    if wants_fan_out(params):
        return await fan_out(lambda p, child: state.backend.complete(prompt, p, cast(str, child), **images_kw),
                             params, rid)  # (a child of a named request is named)
    return [await state.backend.complete(prompt, params, rid, **images_kw)]


async def _first(request: Request, deltas: DeltaStream, grammar_param: str | None):
    """Wait for the first delta before answering 200, so a refused request gets a real 4xx/5xx status."""
    try:
        return await until_disconnect(request, deltas.__anext__())
    except StopAsyncIteration:
        return None
    except SlipstreamError as e:
        raise from_slipstream(e, grammar_param) from None


async def _stream_body(state: ServerState, rid: str, prompt_tokens: int, first, deltas: DeltaStream, events,
                       t0: float, endpoint: str):
    """Sends `events`' SSE for the deltas; ends the request (released, logged, counted) however it ends."""
    n_out, status, finish, cached = 0, 200, None, 0
    task = cast(asyncio.Task, asyncio.current_task())  # (a request's handler runs in a task)
    state.streams.add(task)
    try:
        for event in events.start():
            yield event
        delta = first
        while delta is not None:
            n_out += len(delta.token_ids)
            finish = delta.finish_reason
            if delta.usage is not None:  # the last delta's (a backend may give none: then 0)
                cached = delta.usage.cached_tokens
            for event in events.delta(delta):
                yield event
            if finish is not None:
                break
            delta = await anext(deltas, None)
        for event in events.end(n_out, cached):
            yield event
    except SlipstreamError as e:  # after the 200: the failure travels as an SSE error event
        err = from_slipstream(e)
        status = err.status
        log.warning("stream_failed", request_id=rid, error=repr(e))
        for event in events.error(err):
            yield event
    except asyncio.CancelledError:
        if not state.ending_streams:  # the client went away
            status, finish = 499, "abort"
            raise
        task.uncancel()  # the server is shutting down (ServerState.end_streams): say so, then end
        status, finish = 503, "abort"
        err = ApiError(503, "the server is shutting down; this stream ran past its --shutdown-timeout",
                       "service_unavailable", None, "shutting_down")
        for event in events.error(err):
            yield event
    except BaseException:
        status, finish = 499, "abort"
        raise
    finally:
        state.streams.discard(task)
        await deltas.aclose()  # aborts the request (frees its pages) if it has not finished
        state.release()
        _done(state, rid, endpoint, status, t0, prompt_tokens, n_out, finish)


def _done(state: ServerState, rid: str, endpoint: str, status: int, t0: float, prompt_tokens: int,
          completion_tokens: int, finish: str | None) -> None:
    seconds = time.perf_counter() - t0
    state.metrics.requests.labels(endpoint, str(status)).inc()
    state.metrics.duration.labels(endpoint).observe(seconds)
    log.info("request_done", request_id=rid, endpoint=endpoint, status=status, prompt_tokens=prompt_tokens,
             completion_tokens=completion_tokens, finish_reason=finish, seconds=round(seconds, 4))

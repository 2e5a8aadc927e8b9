"""The FastAPI app: OpenAI-compatible routes over a Backend (in-process Engine or workers).

`create_app(backend)` returns an ASGI app; uvicorn serves it (`slipstream serve`), and anything
that takes an ASGI/FastAPI app (Ray Serve's ingress, test clients) can host it too. The backend
starts and stops with the app's lifespan.
"""
from __future__ import annotations

import asyncio
import inspect
from contextlib import asynccontextmanager
from typing import cast

import msgspec
import structlog
from fastapi import FastAPI
from prometheus_client import generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from starlette.exceptions import HTTPException as StarletteHTTPException

from slipstream.api.encode import encode_off_loop
from slipstream.errors import InvalidRequestError, SlipstreamError
from slipstream.serve import chat_tools, generation, lora, responses, skills
from slipstream.serve.api_errors import ApiError, from_slipstream, invalid
from slipstream.serve.body import DEFAULT_MAX_BODY_BYTES, read_body
from slipstream.serve.backend import Backend
from slipstream.serve.images import ImageServing
from slipstream.serve.openai_types import DetokenizeRequest, TokenizeRequest
from slipstream.serve.state import ServerState, now_s

log = structlog.get_logger(__name__)
_encode = msgspec.json.Encoder().encode


INLINE_IDS = 1024  # /detokenize: up to this many ids decode on the loop (well under a millisecond)
UNKNOWN_CONTEXT_IDS = 131_072  # /detokenize's bound when the workers do not say their context (older ones)


def detokenize_body_limit(max_ids: int) -> int:
    """The largest /detokenize body for `max_ids` ids: 16 bytes an id (digits, comma, indentation)."""
    return 16 * max_ids + 1024


def _json(obj, status: int = 200) -> Response:
    return Response(_encode(obj), status_code=status, media_type="application/json")


_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/point": "point",
              "/v1/detect": "detect", "/v1/responses": "responses"}


def create_app(backend: Backend, max_inflight: int = 1024, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               images: ImageServing | None = None) -> FastAPI:
    state = ServerState(backend, max_inflight=max_inflight, max_body_bytes=max_body_bytes,
                        images=images or ImageServing())

    def refused(request: Request, err: ApiError) -> Response:
        """Every error answer: OpenAI's shape, counted in slipstream_http_requests_total."""
        endpoint = _ENDPOINTS.get(request.url.path, "other")
        state.metrics.requests.labels(endpoint, str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        state.ready = True
        log.info("server_ready", model=backend.model_name)
        try:
            yield
        finally:  # uvicorn has drained in-flight requests (up to its graceful timeout) by now
            state.draining = True
            await backend.close()
            log.info("server_stopped", model=backend.model_name)

    app = FastAPI(title="slipstream", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> Response:
        if e.status >= 500:
            log.warning("request_refused", path=request.url.path, status=e.status, error=e.message)
        return refused(request, e)

    @app.exception_handler(SlipstreamError)
    async def slipstream_error(request: Request, e: SlipstreamError) -> Response:
        return refused(request, from_slipstream(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:  # 404, 405 from routing
        err = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", "invalid_request_error",
                       None, "not_found" if e.status_code == 404 else None)
        err.headers = dict(e.headers) if e.headers is not None else None
        return refused(request, err)

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception) -> Response:  # a bug: still OpenAI's shape
        log.error("request_crashed", path=request.url.path, error=repr(e))
        return refused(request, ApiError(500, f"internal error: {type(e).__name__}", "server_error", None,
                                         "internal_error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation.handle(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation.handle(state, request, chat=True)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:  # stateless (slipstream/serve/responses.py)
        return await responses.handle(state, request)

    @app.post("/v1/point")
    async def point(request: Request) -> Response:  # Moondream's cloud API (slipstream/serve/skills.py)
        return await skills.handle(state, request, "point")

    @app.post("/v1/detect")
    async def detect(request: Request) -> Response:
        return await skills.handle(state, request, "detect")

    @app.get("/v1/models")
    async def models() -> Response:  # the base model, then its LoRA adapters (serve/lora.py)
        return _json({"object": "list", "data": lora.model_cards(backend)})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:  # the OpenAI SDK's models.retrieve
        card = next((c for c in lora.model_cards(backend) if c["id"] == model_id), None)
        if card is None:
            raise ApiError(404, f"the model {model_id!r} does not exist; this server serves {backend.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")
        return _json(card)

    lora.add_routes(app, state)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter

    @app.get("/health")
    async def health() -> Response:
        if not state.ready or state.draining:
            return _json({"status": "draining" if state.draining else "starting"}, 503)
        try:
            stats = await backend.stats()
        except SlipstreamError as e:
            return _json({"status": "unavailable", "error": str(e)}, 503)
        return _json({"status": "ok", "model": backend.model_name, "inflight": state.inflight, "stats": stats})

    @app.get("/metrics")
    async def metrics() -> Response:
        text = backend.metrics_text() if state.ready else ""
        if inspect.isawaitable(text):  # a remote backend gathers its replicas' registries (RayBackend)
            text = await text
        text += generate_latest(state.metrics.registry).decode()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = _decode(await read_body(request, state.max_body_bytes), TokenizeRequest)
        tok = backend.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise invalid("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            generation.check_chat_chars(state, req.messages)
            plan = (chat_tools.plan_of(tok, req.tools, req.tool_choice, req.parallel_tool_calls)
                    if req.tools is not None or req.tool_choice is not None else None)
            text, field = generation.chat_text(tok, req.messages, req.add_generation_prompt, plan), "messages"
        elif req.tools is not None:
            raise invalid("tools are rendered into a chat prompt: give messages with them", "tools")
        else:
            text, field = req.prompt, "prompt"
        try:
            ids = await encode_off_loop(tok, text, state.max_prompt_chars, field)
        except InvalidRequestError as e:
            raise invalid(str(e), field, "prompt_too_long") from None
        return _json({"tokens": ids, "count": len(ids), "max_model_len": backend.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        # at most a context's worth of ids (as vLLM): the body is bounded before it is read, and a
        # long list is decoded on a worker thread (issue 37: 4.1 M ids held the loop 1.4 s)
        most = backend.max_model_len or UNKNOWN_CONTEXT_IDS  # (None: workers that do not say their context)
        raw = await read_body(request, min(state.max_body_bytes, detokenize_body_limit(most)),
                              f"the most {most:,} token ids need")
        req = _decode(raw, DetokenizeRequest)
        if len(req.tokens) > most:
            raise invalid(f"tokens has {len(req.tokens):,} ids; this server detokenizes at most {most:,} "
                          "(its max_model_len)", "tokens", "too_many_tokens")
        if any(t >= backend.vocab_size for t in req.tokens):
            raise invalid(f"token ids must be below the vocabulary size {backend.vocab_size}", "tokens")
        decode = backend.tokenizer.decode
        text = decode(req.tokens) if len(req.tokens) <= INLINE_IDS else await asyncio.to_thread(decode, req.tokens)
        return _json({"prompt": text})

    return app


def _decode(raw: bytes, type_):
    return generation.decode_json(lambda b: msgspec.json.decode(b, type=type_), raw)

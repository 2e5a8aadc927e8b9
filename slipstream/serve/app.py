"""The FastAPI app: OpenAI-compatible routes over a Backend (in-process Engine or workers).

`create_app(backend)` returns an ASGI app; uvicorn serves it (`slipstream serve`), and anything
that takes an ASGI/FastAPI app (Ray Serve's ingress, test clients) can host it too. The backend
starts and stops with the app's lifespan.
"""
from __future__ import annotations

import inspect
from contextlib import asynccontextmanager

import msgspec
import structlog
from fastapi import FastAPI
from prometheus_client import generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from slipstream.errors import SlipstreamError
from slipstream.serve import generation
from slipstream.serve.api_errors import ApiError, from_decode_error, from_slipstream, invalid
from slipstream.serve.backend import Backend
from slipstream.serve.openai_types import DetokenizeRequest, TokenizeRequest
from slipstream.serve.state import ServerState, now_s

log = structlog.get_logger(__name__)
_encode = msgspec.json.Encoder().encode


def _json(obj, status: int = 200) -> Response:
    return Response(_encode(obj), status_code=status, media_type="application/json")


def create_app(backend: Backend, max_inflight: int = 1024) -> FastAPI:
    state = ServerState(backend, max_inflight=max_inflight)

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
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(SlipstreamError)
    async def slipstream_error(request: Request, e: SlipstreamError) -> Response:
        err = from_slipstream(e)
        return JSONResponse(err.body(), status_code=err.status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation.handle(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation.handle(state, request, chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{"id": backend.model_name, "object": "model", "created": now_s(),
                                                  "owned_by": "slipstream"}]})

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
        req = _decode(await request.body(), TokenizeRequest)
        tok = backend.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise invalid("give exactly one of prompt or messages", "prompt")
        if req.messages is not None:
            text = generation.chat_text(tok, req.messages, req.add_generation_prompt)
        else:
            text = req.prompt
        ids = tok.encode(text)
        return _json({"tokens": ids, "count": len(ids), "max_model_len": backend.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = _decode(await request.body(), DetokenizeRequest)
        if any(t >= backend.vocab_size for t in req.tokens):
            raise invalid(f"token ids must be below the vocabulary size {backend.vocab_size}", "tokens")
        return _json({"prompt": backend.tokenizer.decode(req.tokens)})

    return app


def _decode(raw: bytes, type_):
    try:
        return msgspec.json.decode(raw, type=type_)
    except msgspec.DecodeError as e:
        raise from_decode_error(e) from None

"""LoRA adapters over HTTP, as vLLM serves them (docs/lora.md): the request's `model` names an adapter,
`/v1/models` lists the loaded adapters beside the base model, and `POST /v1/load_lora_adapter` /
`/v1/unload_lora_adapter` take `{"lora_name", "lora_path"}`. A backend offers adapters by having
`loras` / `load_lora` / `unload_lora` (the in-process engine does, the workers' backend on every worker;
a backend without them answers 501, and Ray's lists its start's adapters and answers loads with 501).

A `model` that is neither the served model nor a loaded adapter is refused (404 model_not_found) on
a server with adapters; without any, the name is not checked (as before adapters existed).
"""
from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from slipstream.errors import LoraNotFoundError
from slipstream.serve.api_errors import ApiError, invalid
from slipstream.serve.body import read_body
from slipstream.serve.state import now_s

_encode = msgspec.json.Encoder().encode


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str | None = None  # (unload takes only the name)


def adapters(backend) -> list[dict]:
    loras = getattr(backend, "loras", None)
    return loras() if loras is not None else []


def lora_of(backend, model: str | None) -> str | None:
    """The adapter a request's `model` names (None: the base model)."""
    if model is None or model == backend.model_name:
        return None
    names = {a["name"] for a in adapters(backend)}
    if model in names:
        return model
    if names:
        raise LoraNotFoundError(f"the model {model!r} does not exist; this server serves {backend.model_name!r} "
                                f"and the LoRA adapters {sorted(names)}", param="model")
    return None


def model_cards(backend) -> list[dict]:
    created = now_s()
    base = {"id": backend.model_name, "object": "model", "created": created, "owned_by": "slipstream",
            "root": backend.model_name, "parent": None}
    return [base] + [{"id": a["name"], "object": "model", "created": created, "owned_by": "slipstream",
                      "root": a["path"], "parent": backend.model_name} for a in adapters(backend)]


def _json(obj, status: int = 200) -> Response:
    return Response(_encode(obj), status_code=status, media_type="application/json")


async def _body(state, request: Request) -> LoadLoraRequest:
    if not hasattr(state.backend, "load_lora"):
        raise ApiError(501, "this server's backend does not load LoRA adapters", "invalid_request_error", None,
                       "not_implemented")
    try:
        return msgspec.json.decode(await read_body(request, state.max_body_bytes), type=LoadLoraRequest)
    except msgspec.ValidationError as e:
        raise invalid(str(e), None) from None
    except msgspec.DecodeError as e:
        raise invalid(f"the body is not JSON: {e}", None) from None


def add_routes(app, state) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        req = await _body(state, request)
        if req.lora_path is None:
            raise invalid("lora_path is required", "lora_path")
        loaded = await state.backend.load_lora(req.lora_name, req.lora_path)
        return _json({"status": "ok", **loaded})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        req = await _body(state, request)
        await state.backend.unload_lora(req.lora_name)
        return _json({"status": "ok", "name": req.lora_name})

"""POST /v1/point and /v1/detect: Moondream-cloud-compatible region skills over one image.

Body `{"image_url", "object", "max_objects"?, "stream"?}` (Moondream's cloud takes `image_url` and
`object`; `max_objects` is slipstream's bound on the answer). The answer is the backend's
`point` / `detect` result, the dict `Engine.point` / `Engine.detect` return in process, plus
Moondream's `request_id`. The image goes through the same checks as a chat `image_url` part
(slipstream/serve/images.py); every refusal is a 400 in OpenAI's error shape naming the field.
"""
from __future__ import annotations

import time
from typing import Annotated

import msgspec
import structlog
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response

from slipstream.errors import InvalidRequestError, SlipstreamError
from slipstream.serve.api_errors import ApiError, from_slipstream, invalid
from slipstream.serve.body import read_body
from slipstream.serve.generation import ClientGone, decode_json, until_disconnect
from slipstream.serve.images import request_images
from slipstream.serve.state import ServerState, new_request_id

log = structlog.get_logger(__name__)
_encode = msgspec.json.Encoder().encode
MAX_OBJECTS = 64  # per request: each object costs up to 4 values × 5 tokens of decoding
MAX_OBJECT_CHARS = 256


class SkillRequest(msgspec.Struct, kw_only=True):
    """Unknown fields are ignored, as Moondream's and OpenAI's servers do."""

    image_url: Annotated[str, Meta(min_length=1)]
    object: Annotated[str, Meta(min_length=1, max_length=MAX_OBJECT_CHARS)]
    max_objects: Annotated[int, Meta(ge=1, le=MAX_OBJECTS)] = 16
    stream: bool = False


_DECODER = msgspec.json.Decoder(SkillRequest)


async def handle(state: ServerState, request: Request, kind: str) -> Response:
    t0 = time.perf_counter()
    rid = new_request_id(kind, request.headers.get("x-request-id"))
    req = decode_json(_DECODER.decode, await read_body(request, state.max_body_bytes))
    if req.stream:  # (Moondream's cloud does not stream these endpoints either)
        raise invalid(f"stream: /v1/{kind} answers in one response; send stream=false", "stream")
    if not req.object.strip():
        raise invalid("object: name the object to look for (it is blank)", "object")
    if not hasattr(state.backend, "skill"):
        raise ApiError(501, f"/v1/{kind} is not served by this backend", "invalid_request_error", None,
                       "not_implemented")
    try:
        images = await request_images([("image_url", req.image_url)], state.images,
                                      bool(getattr(state.backend, "accepts_images", False)), state.max_body_bytes)
    except InvalidRequestError as e:
        raise invalid(str(e), e.param, "invalid_image") from None
    state.admit()
    try:
        try:
            result = await until_disconnect(request, state.backend.skill(kind, req.object, req.max_objects, images))
        except SlipstreamError as e:
            raise _blame_image(from_slipstream(e)) from None
        _done(state, rid, kind, 200, t0)
        return Response(_encode({"request_id": rid, **result}), media_type="application/json",
                        headers={"x-request-id": rid})
    except ClientGone:
        _done(state, rid, kind, 499, t0)
        return Response(status_code=499)
    finally:
        state.release()


def _blame_image(err: ApiError) -> ApiError:
    """The engine names its `images` argument; over HTTP that picture came from `image_url`."""
    if err.param is not None and err.param.startswith("images"):
        err.param = "image_url"
    return err


def _done(state: ServerState, rid: str, endpoint: str, status: int, t0: float) -> None:
    seconds = time.perf_counter() - t0
    state.metrics.requests.labels(endpoint, str(status)).inc()
    state.metrics.duration.labels(endpoint).observe(seconds)
    log.info("request_done", request_id=rid, endpoint=endpoint, status=status, seconds=round(seconds, 4))

"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status.

`ApiError` is what the HTTP layer raises; `from_slipstream` maps the engine's and the worker
client's typed errors onto statuses (400 invalid, 429 overloaded, 503 closed or draining).
"""
from __future__ import annotations

import re

import msgspec

from slipstream import errors


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers: dict[str, str] | None = None  # e.g. 405's Allow

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# msgspec reports where a value failed as a JSON path suffix, e.g. "... - at `$.messages[0].role`";
# it offers no structured path, so this suffix is the one place its message is read.
_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MISSING = re.compile(r"Object missing required field `([^`]+)`")


def from_decode_error(e: msgspec.DecodeError) -> ApiError:
    text = str(e)
    m = _PATH.search(text)
    if m is None:
        top = _MISSING.fullmatch(text)  # a field of the body itself: msgspec gives no path
        if top:
            return invalid(f"{text} (at {top.group(1)})", top.group(1), "invalid_value")
        return invalid(f"invalid request body: {text}", None, "invalid_body")
    path = m.group("path") or None
    field = text[: m.start()]
    # "Object missing required field `x`" names the field inside the path's object
    missing = _MISSING.fullmatch(field)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return invalid(f"{field} (at {path})" if path else field, path, "invalid_value")


def from_slipstream(e: errors.SlipstreamError, grammar_param: str | None = None) -> ApiError:
    """`grammar_param`: the request field a grammar came from, named when compiling it failed."""
    code = type(e).__name__
    if isinstance(e, errors.OverloadedError):
        return ApiError(429, str(e), "rate_limit_error", None, code)
    if isinstance(e, (errors.EngineClosedError, errors.WorkerUnavailableError)):
        return ApiError(503, str(e), "service_unavailable", None, code)
    if isinstance(e, (errors.GrammarCompileError, errors.GrammarTimeoutError)):
        return invalid(str(e), grammar_param or e.param, code)
    if isinstance(e, errors.LoraNotFoundError):  # as OpenAI answers an unknown model
        return ApiError(404, str(e), "invalid_request_error", e.param, "model_not_found")
    if isinstance(e, (errors.InvalidRequestError, errors.ProtocolError)):
        return invalid(str(e), getattr(e, "param", None), code)
    return ApiError(500, str(e), "server_error", None, code)

"""Reading a request body under a size limit, before any of it is decoded.

A body larger than the limit is refused with 413 as soon as its Content-Length (or, without one,
the bytes received so far) says so: a 10 MB prompt costs neither its decode nor its tokenization.
"""
from __future__ import annotations

from starlette.requests import Request

from slipstream.serve.api_errors import ApiError
from slipstream.serve.state import DEFAULT_MAX_BODY_BYTES  # noqa: F401 (the app imports it from here)


def too_large(size: int, limit: int, why: str = "--max-body-bytes") -> ApiError:
    return ApiError(413, f"request body of {size:,} bytes exceeds this server's limit of {limit:,} bytes "
                         f"({why})", "invalid_request_error", None, "request_too_large")


async def read_body(request: Request, limit: int, why: str = "--max-body-bytes") -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit, why)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(size, limit, why)
        chunks.append(chunk)
    return b"".join(chunks)

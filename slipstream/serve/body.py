"""Reading a request body under a size limit, before any of it is decoded.

A body larger than the limit is refused with 413 as soon as its Content-Length (or, without one,
the bytes received so far) says so: a 10 MB prompt costs neither its decode nor its tokenization.
A client that goes before its whole body arrived is the client's doing, not a server error: 499
(nginx's "client closed request"), or 408 when `--request-read-timeout` closed it; counted under
those statuses, no answer can reach it (issue 37: it was a 500 and a logged crash).
"""
from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from slipstream.serve.api_errors import ApiError
from slipstream.serve.state import DEFAULT_MAX_BODY_BYTES  # noqa: F401 (the app imports it from here)

READ_TIMED_OUT = "slipstream.read_timed_out"  # in the scope of a request --request-read-timeout cut off


def too_large(size: int, limit: int, why: str = "--max-body-bytes") -> ApiError:
    return ApiError(413, f"request body of {size:,} bytes exceeds this server's limit of {limit:,} bytes "
                         f"({why})", "invalid_request_error", None, "request_too_large")


async def read_body(request: Request, limit: int, why: str = "--max-body-bytes") -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(int(declared), limit, why)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(size, limit, why)
            chunks.append(chunk)
    except ClientDisconnect:
        if request.scope.get(READ_TIMED_OUT):
            raise ApiError(408, f"the request was not read in time ({size:,} bytes of its body arrived; "
                                "--request-read-timeout)", "invalid_request_error", None, "request_timeout") from None
        raise ApiError(499, f"the client closed the connection after {size:,} bytes of the body",
                       "invalid_request_error", None, "client_closed_request") from None
    return b"".join(chunks)

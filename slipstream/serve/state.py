"""Per-server state the handlers share: the backend, admission limits, HTTP metrics, request ids."""
from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from slipstream.params import DEFAULT_MAX_PROMPT_CHARS
from slipstream.serve.api_errors import ApiError
from slipstream.serve.backend import Backend
from slipstream.serve.images import ImageServing

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # `slipstream serve --max-body-bytes` (here: needs no starlette)

_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,96}")


class HttpMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("slipstream_http_requests_total", "HTTP requests answered", ["endpoint", "status"],
                                registry=r)
        self.inflight = Gauge("slipstream_http_inflight_requests", "Generation requests in flight", registry=r)
        self.duration = Histogram("slipstream_http_request_seconds", "Generation request time, arrival to last byte",
                                  ["endpoint"], registry=r,
                                  buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))


@dataclass
class ServerState:
    backend: Backend
    max_inflight: int = 1024  # generation requests admitted at once; more get 429
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413 before they are read
    ready: bool = False
    draining: bool = False
    inflight: int = 0
    metrics: HttpMetrics = field(default_factory=HttpMetrics)
    streams: set = field(default_factory=set)  # the tasks sending SSE bodies (end_streams cancels them)
    ending_streams: bool = False
    images: ImageServing = field(default_factory=ImageServing)  # image parts: limits, fetch allow-list

    def end_streams(self) -> None:
        """Shutdown's deadline (slipstream/serve/server.py): each running stream is cancelled and
        answers with an SSE error event."""
        self.ending_streams = True
        for task in list(self.streams):
            task.cancel()

    @property
    def max_prompt_chars(self) -> int:
        """The engine's EngineConfig.max_prompt_chars in process; the default before workers or replicas."""
        return getattr(self.backend, "max_prompt_chars", DEFAULT_MAX_PROMPT_CHARS)

    def admit(self) -> None:
        """Count one generation request in, or refuse it (503 while starting/draining, 429 when full)."""
        if self.draining or not self.ready:
            raise ApiError(503, "the server is " + ("shutting down" if self.draining else "starting"),
                           "service_unavailable", None, "not_ready")
        if self.inflight >= self.max_inflight:
            raise ApiError(429, f"too many requests in flight ({self.max_inflight}); retry later",
                           "rate_limit_error", None, "overloaded")
        self.inflight += 1
        self.metrics.inflight.inc()

    def release(self) -> None:
        self.inflight -= 1
        self.metrics.inflight.dec()


def new_request_id(prefix: str, header: str | None) -> str:
    """A client's X-Request-Id when it is a sane token (made unique), else a fresh random id."""
    suffix = uuid.uuid4().hex[:16]
    if header and _CLIENT_ID.fullmatch(header):
        return f"{prefix}-{header}-{suffix[:8]}"
    return f"{prefix}-{suffix}"


def now_s() -> int:
    return int(time.time())

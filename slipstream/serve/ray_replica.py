"""One engine per Ray Serve replica: the deployment class the HTTP ingress calls through a handle.

Calls take prompt token ids (the ingress tokenizes, and the prefix router hashes those ids).
`generate` is a streaming method: its first item is this replica's id (so the ingress can name
the replica in logs and errors), then StreamDeltas. When the caller cancels (the HTTP client went
away), Ray Serve cancels the generator here and closing the engine stream aborts the request,
freeing its pages. `record_routing_stats` is Ray Serve's per-replica stats hook; the ingress also
calls it for /health and /metrics (engine metrics relabelled with `replica`).
"""
from __future__ import annotations

from collections import Counter, deque
from typing import cast

import structlog
from prometheus_client.metrics_core import Metric

from slipstream.outputs import CompletionOutput
from slipstream.params import EngineConfig, SamplingParams

log = structlog.get_logger(__name__)
RECENT = 512  # request ids each replica remembers for its stats


def relabel(families, replica: str) -> list[Metric]:
    """Copies of the metric families with `replica="<id>"` added to every sample."""
    out = []
    for fam in families:
        m = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        m.samples = [s._replace(labels={**s.labels, "replica": replica}) for s in fam.samples]
        out.append(m)
    return out


class EngineReplica:
    async def __init__(self, config: EngineConfig | dict, model_name: str | None = None):  # type: ignore[misc]  # Ray Serve awaits an async __init__
        from ray import serve

        from slipstream.api.engine import Engine

        self.config = config if isinstance(config, EngineConfig) else EngineConfig(**config)
        self.model_name = model_name or self.config.model
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - constructed outside Serve (unit use)
            self.replica_id = "local"
        self.engine = Engine(self.config)
        await self.engine.start()
        self.finished: Counter[str] = Counter()  # finish_reason → count
        self.recent: deque[str] = deque(maxlen=RECENT)
        self.started_requests = 0
        log.info("engine_replica_ready", replica=self.replica_id, model=self.config.model)

    def info(self) -> dict:
        return {"replica": self.replica_id, "model": self.config.model, "model_name": self.model_name,
                "vocab_size": self.engine.model_config.vocab_size, "max_model_len": self.engine.max_model_len,
                "page_size": self.config.page_size,
                "loras": [{k: a[k] for k in ("name", "path")} for a in self.engine.loras()]}

    def _admit(self, request_id: str) -> None:
        self.started_requests += 1
        self.recent.append(request_id)

    async def generate(self, ids: list[int], params: SamplingParams, request_id: str):
        self._admit(request_id)
        yield self.replica_id
        stream = self.engine.stream(ids, params, request_id=request_id)
        finish = "abort"  # unless the engine says otherwise: cancelled or failed
        try:
            async for delta in stream:
                if delta.finish_reason is not None:
                    finish = delta.finish_reason
                yield delta
        finally:
            await stream.aclose()  # aborts the request (frees its pages) if it has not finished
            self.finished[finish] += 1

    async def complete(self, ids: list[int], params: SamplingParams, request_id: str):
        self._admit(request_id)
        finish = "abort"
        try:
            out = cast(CompletionOutput, await self.engine.complete(ids, params, request_id=request_id))  # (n == 1)
            finish = out.finish_reason
            return self.replica_id, out
        finally:
            self.finished[finish] += 1

    async def record_routing_stats(self) -> dict:
        """Engine stats, what this replica served, and its metric families (labelled `replica`)."""
        return {"replica": self.replica_id, **(await self.engine.stats()), "requests_started": self.started_requests,
                "finished": dict(self.finished), "recent_request_ids": list(self.recent),
                "metrics": relabel(self.engine.metrics.registry.collect(), self.replica_id)}

    async def check_health(self) -> None:
        await self.engine.stats()  # raises EngineClosedError once the engine has stopped

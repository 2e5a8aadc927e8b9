"""The HTTP app's Backend over Ray Serve engine replicas (`slipstream serve --ray`).

Runs inside the ingress replica. Every call goes through a DeploymentHandle to the engine
deployment, whose request router (slipstream.serve.ray_router) picks the replica by prompt prefix.
Ray's failures become slipstream's typed errors: a replica that dies or becomes unreachable fails
its in-flight requests with ReplicaUnavailableError (HTTP 503, or an SSE error event once the
stream has started); an error the engine raised (bad request, ...) arrives as itself.
"""
from __future__ import annotations

import asyncio
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from ray import exceptions as rx

from slipstream.errors import ReplicaUnavailableError, RequestFailedError, SlipstreamError
from slipstream.serve.api_errors import ApiError

log = structlog.get_logger(__name__)
_REPLICA_PREFIX = "SERVE_REPLICA::"


# A load must reach every replica, the ones Ray Serve starts later (autoscaling, a restart) too, which
# build their engine from the deployment's EngineConfig: run-time loads are not offered (docs/lora.md).
def _no_lora_loading() -> ApiError:
    return ApiError(501, "this server's Ray Serve replicas serve the LoRA adapters given at start (--lora); they do "
                    "not load or unload adapters at run time", "invalid_request_error", None, "not_implemented")


def _translate(e: BaseException, request_id: str, replica: str | None) -> BaseException:
    where = f"engine replica {replica}" if replica else "the engine replica"
    if isinstance(e, rx.RayTaskError) and isinstance(e.cause, SlipstreamError):
        return e.cause
    if isinstance(e, (rx.RayActorError, rx.ActorUnavailableError)):
        return ReplicaUnavailableError(f"{where} died or became unreachable while serving {request_id}; "
                                       f"retry (new requests go to the surviving replicas): {type(e).__name__}")
    if isinstance(e, rx.RayTaskError):
        return RequestFailedError(f"{where} failed request {request_id}: {e.cause!r}")
    return e


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge_metrics(per_replica: list[list]) -> str:
    """One Prometheus text from every replica's families (same family → one HELP/TYPE, all samples)."""
    merged: dict[str, Any] = {}
    for families in per_replica:
        for fam in families:
            if fam.name in merged:
                merged[fam.name].samples.extend(fam.samples)
            else:
                merged[fam.name] = fam
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry).decode()


class RayBackend:
    def __init__(self, handle, model_name: str | None = None, stats_timeout: float = 5.0):
        self.handle = handle
        self._model_name = model_name
        self.stats_timeout = stats_timeout
        self._loras: list[dict] = []

    async def start(self) -> None:
        from slipstream.serve.tokenizer_load import load_tokenizer

        info = await self.handle.info.remote()
        self.model_name = self._model_name or info["model_name"]
        self.page_size = info["page_size"]
        self.tokenizer, self.vocab_size = await asyncio.to_thread(load_tokenizer, info["model"])
        self.max_model_len = info["max_model_len"]
        self._loras = list(info.get("loras", ()))  # every replica's: each starts from the same EngineConfig
        log.info("ray_replicas_connected", deployment=self.handle.deployment_name, model=info["model"])

    async def close(self) -> None:
        pass  # Ray Serve owns the replicas

    # --- LoRA adapters (serve/lora.py): those of `--lora`, loaded by every replica at its start --------

    def loras(self) -> list[dict]:
        return self._loras

    async def load_lora(self, name: str, path: str) -> dict:
        raise _no_lora_loading()

    async def unload_lora(self, name: str) -> None:
        raise _no_lora_loading()

    async def stream(self, ids, params, request_id):
        gen = self.handle.options(stream=True).generate.remote(ids, params, request_id)
        replica, done = None, False
        try:
            try:
                replica = await gen.__anext__()
                async for delta in gen:
                    yield delta
                done = True
            except StopAsyncIteration:
                done = True
            except (rx.RayError, rx.ActorUnavailableError) as e:
                done = True
                err = _translate(e, request_id, replica)
                log.warning("replica_request_failed", request_id=request_id, replica=replica, error=repr(err))
                raise err from None
        finally:
            if not done:  # the client went away (or the stream was closed early): abort on the replica
                gen.cancel()

    async def complete(self, ids, params, request_id):
        try:
            _, out = await self.handle.complete.remote(ids, params, request_id)
        except (rx.RayError, rx.ActorUnavailableError) as e:
            raise _translate(e, request_id, None) from None
        return out

    async def _replica_stats(self) -> list[dict]:
        import ray

        app, dep = self.handle.app_name, self.handle.deployment_name
        prefix = f"{_REPLICA_PREFIX}{app}#{dep}#"
        named = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        actors = [ray.get_actor(a["name"], namespace=a["namespace"]) for a in named
                  if a["name"].startswith(prefix)]

        async def one(actor):
            try:
                return await asyncio.wait_for(actor.record_routing_stats.remote(), self.stats_timeout)
            except Exception as e:  # noqa: BLE001 - a dead or stuck replica is reported, not raised
                return {"error": repr(e)}

        return list(await asyncio.gather(*(one(a) for a in actors)))

    async def stats(self) -> dict:
        per = await self._replica_stats()
        ok = [s for s in per if "error" not in s]
        total = {k: sum(s.get(k, 0) for s in ok) for k in ("kv_pages_free", "kv_pages_total", "running", "waiting",
                                                           "prefix_cache_queries", "prefix_cache_hits")}
        q = total["prefix_cache_queries"]  # each replica's own rate is in its entry below
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / q if q else 0.0
        return {**total, "replicas": [{k: v for k, v in s.items() if k != "metrics"} for s in per]}

    async def metrics_text(self) -> str:
        per = await self._replica_stats()
        return merge_metrics([s["metrics"] for s in per if "metrics" in s])

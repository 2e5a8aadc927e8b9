"""slipstream on Ray Serve: N engine replicas behind the OpenAI app, routed by prompt prefix.

    from ray import serve
    from slipstream.params import EngineConfig
    from slipstream.serve.ray_app import RayServeOptions, build_app

    serve.run(build_app(EngineConfig(model="smollm2-135m"), RayServeOptions(replicas=2)),
              name="slipstream", route_prefix="/")

Two deployments: `SlipstreamEngine` (one Engine per replica, `ray_actor_options` num_cpus /
num_gpus, the prefix-aware request router) and `SlipstreamIngress` (the FastAPI app of
`slipstream serve` over a RayBackend holding a handle to the engines). docs/scale-out.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from ray import serve
from ray.serve.config import RequestRouterConfig

from slipstream.params import EngineConfig
from slipstream.serve.app import create_app
from slipstream.serve.ray_backend import RayBackend
from slipstream.serve.ray_replica import EngineReplica

ENGINE_DEPLOYMENT = "SlipstreamEngine"
INGRESS_DEPLOYMENT = "SlipstreamIngress"
ROUTER_CLASS = "slipstream.serve.ray_router.PrefixAwareRouter"


@dataclass
class RayServeOptions:
    replicas: int = 1  # ignored when `autoscaling` is given
    num_cpus: float = 1.0  # per engine replica
    num_gpus: float = 0.0  # per engine replica: 1 on a GPU cluster
    ingress_num_cpus: float = 0.0  # the HTTP ingress mostly waits; 0 leaves the cores to the engines
    max_ongoing_requests: int = 256  # per engine replica; the router sends no more than this to one
    imbalance_threshold: int = 8  # queue-length spread past which prefix affinity yields to balance
    autoscaling: dict[str, Any] | None = None  # Ray Serve's autoscaling_config, passed through
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 10.0
    max_inflight: int = 1024  # the ingress's HTTP admission limit (429 past it)
    extra_actor_options: dict[str, Any] = field(default_factory=dict)  # e.g. runtime_env, resources

    def __post_init__(self) -> None:
        if self.autoscaling is None and self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError("num_cpus and num_gpus must not be negative")
        if self.imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must not be negative, got {self.imbalance_threshold}")


class SlipstreamIngress:
    def __init__(self, engine_handle, model_name: str | None = None, max_inflight: int = 1024):
        self.backend = RayBackend(engine_handle, model_name)
        self.max_inflight = max_inflight

    def __serve_build_asgi_app__(self):
        return create_app(self.backend, max_inflight=self.max_inflight)  # type: ignore[arg-type]  # RayBackend takes no images


def engine_deployment(config: EngineConfig, options: RayServeOptions, model_name: str | None = None):
    scale: dict[str, Any] = ({"autoscaling_config": options.autoscaling} if options.autoscaling is not None
                             else {"num_replicas": options.replicas})
    return serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT, **scale,
        ray_actor_options={"num_cpus": options.num_cpus, "num_gpus": options.num_gpus,
                           **options.extra_actor_options},
        max_ongoing_requests=options.max_ongoing_requests,
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=options.health_check_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASS,  # type: ignore[arg-type]  # (Ray takes an import path too)
            request_router_kwargs={"page_size": config.page_size,
                                   "imbalance_threshold": options.imbalance_threshold}),
    ).bind(config, model_name)  # type: ignore[attr-defined]  # (Ray's stubs: a Deployment)


def build_app(config: EngineConfig, options: RayServeOptions | None = None, model_name: str | None = None):
    """The Serve application: run it with `serve.run(app, name=..., route_prefix="/")`."""
    options = options or RayServeOptions()
    ingress = serve.deployment(serve.ingress()(SlipstreamIngress), name=INGRESS_DEPLOYMENT,
                               ray_actor_options={"num_cpus": options.ingress_num_cpus})
    return ingress.bind(engine_deployment(config, options, model_name), model_name,  # type: ignore[attr-defined]
                        options.max_inflight)


def app_builder(args: dict[str, Any]):
    """For Ray Serve's own CLI and config files: `serve run slipstream.serve.ray_app:app_builder
    model=smollm2-135m replicas=2` (engine fields and RayServeOptions fields by name; strings from
    the command line are converted to the fields' types)."""
    engine_fields = set(EngineConfig.__struct_fields__)
    option_fields = set(RayServeOptions.__dataclass_fields__)
    unknown = set(args) - engine_fields - option_fields - {"model_name"}
    if unknown:
        raise ValueError(f"unknown app arguments: {sorted(unknown)}")
    engine = {k: v for k, v in args.items() if k in engine_fields}
    config = msgspec.convert(engine, EngineConfig, strict=False)
    types = {"replicas": int, "num_cpus": float, "num_gpus": float, "ingress_num_cpus": float,
             "max_ongoing_requests": int, "imbalance_threshold": int, "max_inflight": int,
             "health_check_period_s": float, "health_check_timeout_s": float}
    opts = {k: types[k](v) if k in types else v for k, v in args.items() if k in option_fields}
    return build_app(config, RayServeOptions(**opts), args.get("model_name"))

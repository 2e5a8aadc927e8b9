"""`slipstream serve --ray` options → RayServeOptions → the Serve deployments (no cluster started)."""
import argparse

import pytest

from slipstream.errors import InvalidRequestError

pytest.importorskip("ray.serve")

from slipstream.commands import serve as serve_cmd  # noqa: E402
from slipstream.commands.serve_ray import options  # noqa: E402
from slipstream.params import EngineConfig  # noqa: E402
from slipstream.serve.ray_app import ENGINE_DEPLOYMENT, ROUTER_CLASS, RayServeOptions, engine_deployment  # noqa: E402


def parse(*argv):
    p = argparse.ArgumentParser()
    serve_cmd.register(p.add_subparsers())
    return p.parse_args(["serve", *argv])


def test_cli_fixed_replicas_and_autoscaling_pass_through():
    o = options(parse("--ray", "--replicas", "3", "--num-gpus-per-replica", "1", "--imbalance-threshold", "4"))
    assert (o.replicas, o.num_gpus, o.imbalance_threshold, o.autoscaling) == (3, 1.0, 4, None)
    o = options(parse("--ray", "--replicas", "2", "--min-replicas", "1", "--max-replicas", "8"))
    assert o.autoscaling == {"min_replicas": 1, "max_replicas": 8, "initial_replicas": 2,
                             "target_ongoing_requests": 32.0}
    with pytest.raises(InvalidRequestError, match="go together"):  # `slipstream: error: ...`, exit 2
        options(parse("--ray", "--min-replicas", "1"))


def test_engine_deployment_carries_router_resources_and_autoscaling():
    cfg = EngineConfig(model="tiny-random", page_size=8)
    d = engine_deployment(cfg, RayServeOptions(replicas=3, num_cpus=2, num_gpus=1))._bound_deployment
    assert d.name == ENGINE_DEPLOYMENT and d.num_replicas == 3
    assert d.ray_actor_options["num_cpus"] == 2 and d.ray_actor_options["num_gpus"] == 1
    router = d._deployment_config.request_router_config
    assert router.request_router_class == ROUTER_CLASS and router.request_router_kwargs["page_size"] == 8
    auto = engine_deployment(cfg, RayServeOptions(autoscaling={"min_replicas": 1, "max_replicas": 4}))
    assert auto._bound_deployment._deployment_config.autoscaling_config.max_replicas == 4


def test_options_validate():
    with pytest.raises(ValueError, match="replicas"):
        RayServeOptions(replicas=0)
    with pytest.raises(ValueError, match="imbalance_threshold"):
        RayServeOptions(imbalance_threshold=-1)


def test_app_builder_for_serve_run_converts_cli_strings():
    from slipstream.serve.ray_app import app_builder

    app = app_builder({"model": "tiny-random", "page_size": "8", "replicas": "2", "num_cpus": "1"})
    engine = app._bound_deployment.init_args[0]._bound_deployment
    assert engine.num_replicas == 2 and engine.init_args[0].page_size == 8
    with pytest.raises(ValueError, match="unknown"):
        app_builder({"model": "tiny-random", "replica": "2"})

"""`slipstream serve --ray`: engine replicas on Ray Serve behind the same OpenAI app (docs/scale-out.md).

Starts a local Ray cluster, or joins one with --ray-address (`ray start --head` on the head node,
`ray start --address HEAD:6379` on the others), deploys slipstream.serve.ray_app and blocks until
SIGINT/SIGTERM, then shuts the Serve application down.
"""
from __future__ import annotations

import signal
import threading

from slipstream.cli import needs_extra
from slipstream.errors import InvalidRequestError


def add_args(p) -> None:
    g = p.add_argument_group("Ray Serve (--ray)")
    g.add_argument("--ray", action="store_true", help="run engine replicas on Ray Serve (needs the `ray` extra)")
    g.add_argument("--replicas", type=int, default=1, help="engine replicas (with --ray)")
    g.add_argument("--ray-address", default=None, help="an existing Ray cluster ('auto' or HOST:PORT); "
                   "default: start a local one")
    g.add_argument("--num-cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves for each replica")
    g.add_argument("--num-gpus-per-replica", type=float, default=0.0, help="1 on a GPU cluster")
    g.add_argument("--min-replicas", type=int, default=None, help="with --max-replicas: Ray Serve autoscaling "
                   "instead of a fixed --replicas")
    g.add_argument("--max-replicas", type=int, default=None, help="with --min-replicas: the most replicas "
                   "autoscaling may start")
    g.add_argument("--target-ongoing-requests", type=float, default=32.0, help="autoscaling target per replica")
    g.add_argument("--imbalance-threshold", type=int, default=8, help="queue-length spread past which prefix "
                   "affinity gives way to power-of-two-choices")


def options(args):
    from slipstream.serve.ray_app import RayServeOptions

    autoscaling = None
    if (args.min_replicas is None) != (args.max_replicas is None):
        raise InvalidRequestError("--min-replicas and --max-replicas go together",
                                  param="min_replicas" if args.max_replicas is None else "max_replicas")
    if args.min_replicas is not None:
        autoscaling = {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                       "initial_replicas": max(args.min_replicas, min(args.replicas, args.max_replicas)),
                       "target_ongoing_requests": args.target_ongoing_requests}
    return RayServeOptions(replicas=args.replicas, num_cpus=args.num_cpus_per_replica,
                           num_gpus=args.num_gpus_per_replica, imbalance_threshold=args.imbalance_threshold,
                           autoscaling=autoscaling, max_inflight=args.max_inflight)


def run(args, config) -> int:
    if args.connect:
        raise InvalidRequestError("--ray and --connect are two different back ends: give one", param="connect")
    try:
        import ray
        from ray import serve

        from slipstream.serve.ray_app import build_app
    except ImportError as e:
        raise needs_extra("ray", "slipstream serve --ray", e) from None
    opts = options(args)
    ray.init(address=args.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(config, opts, args.served_model_name), name="slipstream", route_prefix="/")
        print(f"slipstream on Ray Serve: http://{args.host}:{args.port}/v1 ({opts.replicas} replica(s); "
              "Ctrl-C stops)", flush=True)
        stop.wait()
    finally:
        serve.delete("slipstream")
        if args.ray_address is None:
            serve.shutdown()
            ray.shutdown()
    return 0

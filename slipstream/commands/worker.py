"""`slipstream worker --bind ADDRESS`: serve one engine to slipstream.Client over ZeroMQ."""
from __future__ import annotations

import argparse

from slipstream.cli import add_batch_args, add_engine_args, add_lora_args, engine_config, lora_fields


def register(sub) -> None:
    from slipstream.api.protocol import MAX_IMAGE_BYTES, MAX_MESSAGE_BYTES

    p = sub.add_parser("worker", help="run the engine in this process, serving clients over ZeroMQ")
    p.add_argument("--bind", required=True, metavar="ADDRESS",
                   help="ipc:///path/to.sock or tcp://127.0.0.1:PORT")
    p.add_argument("--max-queued", type=int, default=256,
                   help="unfinished requests allowed beyond the batch; more are answered 'overloaded'")
    p.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES,
                   help="largest message a client may send (a prompt past it is refused naming `prompt`; images "
                        "have their own bound)")
    p.add_argument("--max-image-bytes", type=int, default=MAX_IMAGE_BYTES,
                   help="a request's encoded image bytes, allowed beyond --max-message-bytes; more are refused "
                        "naming `images`")
    p.add_argument("--max-unsent-frames", type=int, default=1000,
                   help="per client: output frames its connection has not taken yet; a client that lets this many "
                        "pile up (it stopped reading) is dropped and its requests aborted")
    p.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats to clients")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT")
    add_batch_args(p)
    add_lora_args(p)
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics")
    p.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                   help="trace steps for the bubble series (slipstream_device_idle_seconds, "
                        "slipstream_forward_seconds); --no-trace saves ~0.1 ms per step "
                        "(tools/profile/bench_trace_cost.py) and leaves them empty")
    add_engine_args(p, log_level="info")  # start/ready/client/shutdown lines are the point
    p.set_defaults(func=_worker)


def _worker(args) -> int:
    from slipstream.api.worker import WorkerLimits, serve
    config = engine_config(args, max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
                           kv_cache_tokens=args.kv_cache_tokens, page_size=args.page_size, seed=args.seed,
                           trace=args.trace, **lora_fields(args))
    limits = WorkerLimits(max_queued=args.max_queued, max_message_bytes=args.max_message_bytes,
                          heartbeat_s=args.heartbeat, shutdown_timeout_s=args.shutdown_timeout,
                          metrics_port=args.metrics_port, max_unsent_frames=args.max_unsent_frames,
                          max_image_bytes=args.max_image_bytes)
    return serve(config, args.bind, limits)

"""`slipstream serve`: the OpenAI-compatible HTTP server (docs/serving.md).

In-process engine by default; with --connect (repeatable) the HTTP front end spreads requests over
running `slipstream worker`s; with --ray --replicas N, engine replicas on Ray Serve (docs/scale-out.md). SIGTERM/SIGINT stop accepting, let in-flight requests finish (up to
--shutdown-timeout), then close the engine or the worker connections.
"""
from __future__ import annotations

import signal

from slipstream.cli import add_batch_args, add_engine_args, add_lora_args, engine_config, lora_fields, needs_extra
from slipstream.commands import serve_ray
from slipstream.images import ImageLimits


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API over HTTP (FastAPI + uvicorn)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--connect", action="append", metavar="ADDRESS", default=None,
                   help="a running `slipstream worker` (ipc://… or tcp://…); repeat to spread over several. "
                        "--model/--device are then the workers'")
    p.add_argument("--timeout", type=float, default=30.0, help="with --connect: seconds of worker silence "
                   "before a request fails")
    p.add_argument("--served-model-name", default=None, help="the model id /v1/models reports (default: --model)")
    p.add_argument("--max-inflight", type=int, default=1024, help="generation requests at once; more get 429")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024,
                   help="larger request bodies get 413 before they are read (prompts are also capped by "
                        "--max-prompt-chars before they are tokenized)")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer prompts get 400 before they are tokenized (default: EngineConfig's, 1,000,000)")
    p.add_argument("--request-read-timeout", type=float, default=30.0,
                   help="seconds a client gets to send a whole request (headers and body) from when it connects "
                        "or starts the request; a slower or idle connection is closed")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT")
    p.add_argument("--allowed-image-hosts", default="", metavar="HOST[,HOST...]",
                   help="hosts whose http(s) image URLs the server may fetch ('*': any). Default: none; images "
                        "then come only as data: URLs. Fetching lets clients make this server send requests: "
                        "list only hosts you trust")
    p.add_argument("--image-fetch-timeout", type=float, default=10.0,
                   help="seconds one remote image may take to fetch, connect to last byte")
    p.add_argument("--max-images", type=int, default=8, help="images per request; more get 400")
    p.add_argument("--max-request-pixels", type=int, default=ImageLimits.max_request_pixels,
                   help="pixels of all of a request's images together (from their headers, before decoding); "
                        "more get 400")
    p.add_argument("--max-pixels-in-flight", type=int, default=ImageLimits.max_inflight_pixels,
                   help="pixels of decoded images the server holds at once (3 bytes each); a request that would "
                        "pass it gets 429")
    add_lora_args(p)  # (refused with --connect: the workers hold the adapters)
    serve_ray.add_args(p)
    add_batch_args(p)
    add_engine_args(p, log_level="info")
    p.set_defaults(func=_serve)


def _engine_config(args):
    extra = {} if args.max_prompt_chars is None else {"max_prompt_chars": args.max_prompt_chars}
    extra.update(lora_fields(args))
    return engine_config(args, max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
                         kv_cache_tokens=args.kv_cache_tokens, page_size=args.page_size, seed=args.seed, **extra)


def build_backend(args):
    from slipstream.serve.backend import ClientsBackend, EngineBackend

    if args.connect:
        if getattr(args, "lora", None):
            from slipstream.errors import InvalidRequestError

            raise InvalidRequestError("--lora with --connect: the workers hold the adapters (slipstream worker "
                                      "--lora NAME=PATH, or POST /v1/load_lora_adapter on this server)", param="lora")
        return ClientsBackend(args.connect, timeout=args.timeout, model_name=args.served_model_name)
    return EngineBackend(_engine_config(args), model_name=args.served_model_name)


def image_serving(args):
    from slipstream.serve.images import ImageServing

    hosts = frozenset(h.strip().lower() for h in args.allowed_image_hosts.split(",") if h.strip())
    limits = ImageLimits(max_images=args.max_images, max_request_pixels=args.max_request_pixels,
                         max_inflight_pixels=args.max_pixels_in_flight)
    return ImageServing(limits, hosts, args.image_fetch_timeout)


def _serve(args) -> int:
    from slipstream.api.addresses import check_port_free

    if args.ray:
        if not args.ray_address:  # (a Ray cluster's proxy listens on its head, not here)
            check_port_free(args.host, args.port)
        return serve_ray.run(args, _engine_config(args))
    try:
        import uvicorn

        from slipstream.serve.app import create_app
    except ImportError as e:
        raise needs_extra("serve", "slipstream serve", e) from None
    check_port_free(args.host, args.port)  # before the model loads: one error line now, not uvicorn's later
    app = create_app(build_backend(args), max_inflight=args.max_inflight, max_body_bytes=args.max_body_bytes,
                     images=image_serving(args))
    from slipstream.serve.read_timeout import read_timeout_protocol

    config = uvicorn.Config(app, host=args.host, port=args.port, loop="uvloop",
                            http=read_timeout_protocol(args.request_read_timeout),
                            log_level=args.log_level, access_log=False, timeout_graceful_shutdown=args.shutdown_timeout)
    from slipstream.serve.server import Server

    server = Server(config)
    # uvicorn re-raises the signal that stopped it once it has drained; a no-op handler turns that
    # into a clean exit status (0) after a graceful shutdown instead of death by SIGTERM
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0 if server.started else 1

"""Command line entry point: `slipstream <command>`. Each command lives in slipstream/commands/."""
from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
COMMANDS = [
    "slipstream.commands.generate",
    "slipstream.commands.bench",
    "slipstream.commands.timeline",
    "slipstream.commands.worker",
    "slipstream.commands.serve",
]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model name, .gguf path, HF folder, or tiny-random / random-smollm2-135m (random weights)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--pipeline-depth", type=int, default=2, choices=[1, 2])
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def engine_config(args, **overrides):
    from slipstream.params import EngineConfig

    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                        pipeline_depth=args.pipeline_depth, **overrides)


def run_async(coro) -> int:
    """Run a command coroutine on uvloop (the engine's loop of choice)."""
    import uvloop

    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream", description="Pipelined LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    args = parser.parse_args(argv)

    from slipstream.errors import SlipstreamError
    from slipstream.logging_setup import configure_logging

    configure_logging(getattr(args, "log_level", "warning"))
    try:
        return args.func(args)
    except SlipstreamError as e:
        print(f"slipstream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

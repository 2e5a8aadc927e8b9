"""Command line: `slipstream generate PROMPT` (and later worker / bench / timeline)."""
from __future__ import annotations

import argparse
import asyncio
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model name, .gguf path, HF folder or tiny-random")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--pipeline-depth", type=int, default=2, choices=[1, 2])
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def _engine_config(args):
    from slipstream.params import EngineConfig

    return EngineConfig(model=args.model, device=args.device, dtype=args.dtype, pipeline_depth=args.pipeline_depth)


async def _generate(args) -> int:
    from slipstream import Engine, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [])
    async with Engine(_engine_config(args)) as engine:
        prompt = args.prompt
        if not args.raw and getattr(engine.tokenizer, "chat_template", None):
            prompt = engine.chat_prompt([{"role": "user", "content": args.prompt}])
        finish = None
        async for delta in engine.stream(prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            finish = delta.finish_reason or finish
        sys.stdout.write("\n")
        if args.verbose:
            print(f"[finish_reason={finish}] {engine.stats()}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt, streaming to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    gen.add_argument("-v", "--verbose", action="store_true")
    _add_engine_args(gen)
    args = parser.parse_args(argv)

    from slipstream.errors import SlipstreamError
    from slipstream.logging_setup import configure_logging

    configure_logging(args.log_level)
    try:
        import uvloop

        return uvloop.run(_generate(args))
    except SlipstreamError as e:
        print(f"slipstream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

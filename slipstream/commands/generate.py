"""`slipstream generate PROMPT`: stream one answer to stdout."""
from __future__ import annotations

import os
import sys

from slipstream.cli import add_engine_args, engine_config, run_async


def register(sub) -> None:
    p = sub.add_parser("generate", help="answer one prompt, streaming to stdout")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("-v", "--verbose", action="store_true", help="print finish reason and engine stats to stderr")
    p.add_argument("--connect", metavar="ADDRESS", help="use a running `slipstream worker` (ipc://… or tcp://…) "
                   "instead of loading the model here; --model/--device are then the worker's")
    p.add_argument("--timeout", type=float, default=30.0, help="with --connect: seconds of worker silence "
                   "before giving up")
    p.add_argument("--no-weight-cache", action="store_true", help="dequantise the GGUF afresh instead of using the "
                   "converted-weights cache (same as SLIPSTREAM_WEIGHT_CACHE=0; see docs/models.md)")
    add_engine_args(p)
    p.set_defaults(func=lambda args: run_async(_generate(args)))


async def _generate(args) -> int:
    from slipstream import Engine, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [])
    if args.connect:
        return await _generate_remote(args, params)
    if args.no_weight_cache:
        os.environ["SLIPSTREAM_WEIGHT_CACHE"] = "0"  # read by the loader inside this process only
    async with Engine(engine_config(args)) as engine:
        prompt = args.prompt
        if not args.raw and getattr(engine.tokenizer, "chat_template", None):
            prompt = engine.chat_prompt([{"role": "user", "content": args.prompt}])
        finish = await _print_stream(engine.stream(prompt, params))
        if args.verbose:
            print(f"[finish_reason={finish}] {engine.stats()}", file=sys.stderr)
    return 0


async def _generate_remote(args, params) -> int:
    from slipstream import Client

    async with Client(args.connect, timeout=args.timeout) as client:
        if not args.raw and client.info.chat_template:
            deltas = client.chat_stream([{"role": "user", "content": args.prompt}], params)
        else:
            deltas = client.stream(args.prompt, params)
        finish = await _print_stream(deltas)
        if args.verbose:
            print(f"[finish_reason={finish}] {await client.stats()}", file=sys.stderr)
    return 0


async def _print_stream(deltas) -> str | None:
    finish = None
    async for delta in deltas:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        finish = delta.finish_reason or finish
    sys.stdout.write("\n")
    return finish

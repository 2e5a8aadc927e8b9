"""`slipstream generate PROMPT`: stream one answer to stdout, a one-line summary to stderr."""
from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass
from typing import cast

from slipstream.cli import add_engine_args, engine_config, run_async


def register(sub) -> None:
    p = sub.add_parser("generate", help="answer one prompt, streaming to stdout")
    p.add_argument("prompt", help="the user message (or, with --raw, the whole prompt text)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the engine's sequence)")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image file for a vision-language model (repeatable, in order); checked before the "
                        "model loads. With --raw, the prompt marks each with <image> (none: images go first)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per engine step; moondream2 computes its 730-token image prefix in one step, so it "
                        "needs at least 730")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("-q", "--quiet", action="store_true", help="no summary line on stderr")
    p.add_argument("-v", "--verbose", action="store_true", help="also print the engine stats to stderr")
    p.add_argument("--connect", metavar="ADDRESS", help="use a running `slipstream worker` (ipc://… or tcp://…) "
                   "instead of loading the model here; --model/--device are then the worker's")
    p.add_argument("--timeout", type=float, default=30.0, help="with --connect: seconds of worker silence "
                   "before giving up")
    p.add_argument("--no-weight-cache", action="store_true", help="dequantise the GGUF afresh instead of using the "
                   "converted-weights cache (same as SLIPSTREAM_WEIGHT_CACHE=0; see docs/models.md)")
    p.add_argument("--wait-ready", type=float, default=30.0, metavar="SECONDS",
                   help="with --connect: how long to keep retrying the handshake while the worker starts "
                        "(it answers only once its model is loaded)")
    add_engine_args(p)
    p.set_defaults(func=lambda args: run_async(_generate(args)))


@dataclass
class Summary:
    """What the stderr line reports; times are perf_counter seconds."""

    submitted: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    finish_reason: str | None = None

    def line(self, max_tokens: int) -> str:
        reason = self.finish_reason or "none"
        if reason == "length" and self.tokens >= max_tokens:
            reason = f"length (hit --max-tokens {max_tokens})"
        if self.first_token is None:
            return f"[{self.tokens} tokens, finish: {reason}]"
        ttft = self.first_token - self.submitted
        # decode speed: tokens after the first over the time after the first (TTFT is reported apart);
        # when they all came in one burst (short answers), tokens over the whole time instead
        last = cast(float, self.last_token)  # (set with first_token)
        span = last - self.first_token
        if self.tokens > 1 and span >= 0.01:
            rate = (self.tokens - 1) / span
        else:
            rate = self.tokens / max(last - self.submitted, 1e-9)
        return f"[{self.tokens} tokens, {rate:.1f} tok/s, TTFT {ttft * 1e3:.0f} ms, finish: {reason}]"


async def _generate(args) -> int:
    from slipstream import Engine, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop or ()))
    if args.prompt == "" and not args.image:
        from slipstream.errors import InvalidRequestError

        # refused in both modes: raw it is no tokens (the engine's refusal); chat would answer a template
        raise InvalidRequestError("prompt is empty: give the message to answer (with --raw, the text to continue)",
                                  param="prompt")
    images = await _load_images(args.image)  # a bad file is refused before any model loads
    if args.connect:
        return await _generate_remote(args, params, images)
    if args.no_weight_cache:
        os.environ["SLIPSTREAM_WEIGHT_CACHE"] = "0"  # read by the loader inside this process only
    async with Engine(engine_config(args, max_num_batched_tokens=args.max_num_batched_tokens)) as engine:
        prompt = args.prompt
        if images:
            from slipstream.images import model_accepts_images, require_vision

            require_vision(model_accepts_images(engine.model_config), "--image")
        templated = getattr(engine.tokenizer, "chat_template", None) is not None
        if not args.raw and templated:  # the engine renders (image parts too) and tokenizes as a chat
            parts = [{"type": "image", "image": im} for im in images] + [{"type": "text", "text": args.prompt}]
            deltas = engine.chat_stream([{"role": "user", "content": parts if images else args.prompt}], params)
        else:  # (Moondream has no template: its prompt is the reference's query template)
            deltas = engine.stream(prompt, params, images=images)
        summary = await _print_stream(deltas)
        _report(args, summary, await engine.stats() if args.verbose else None)
    return 0


async def connect(address: str, timeout: float, wait_ready: float):
    """A started Client; retries the connection and handshake until `wait_ready` seconds have passed."""
    from slipstream import Client, WorkerUnavailableError
    from slipstream.errors import WorkerShuttingDownError

    deadline = time.monotonic() + max(wait_ready, 0.0)
    while True:
        left = deadline - time.monotonic()
        client = Client(address, timeout=timeout, connect_timeout=max(min(left, timeout), 0.5))
        try:
            return await client.start()
        except WorkerUnavailableError as e:
            if isinstance(e, WorkerShuttingDownError) or time.monotonic() >= deadline:
                raise WorkerUnavailableError(f"{e} (waited {wait_ready:g} s; see --wait-ready)") from e
            await asyncio.sleep(0.2)


async def _load_images(paths: list[str]) -> list:
    if not paths:
        return []
    from slipstream.images import load_images

    return await load_images(paths, [f"--image {p}" for p in paths])


async def _generate_remote(args, params, images: list) -> int:
    client = await connect(args.connect, args.timeout, args.wait_ready)
    kw = {"images": images} if images else {}
    try:
        if not args.raw and client.info.chat_template:
            deltas = client.chat_stream([{"role": "user", "content": args.prompt}], params, **kw)
        else:
            deltas = client.stream(args.prompt, params, **kw)
        summary = await _print_stream(deltas)
        _report(args, summary, await client.stats() if args.verbose else None)
    finally:
        await client.close()
    return 0


async def _print_stream(deltas) -> Summary:
    summary = Summary(submitted=time.perf_counter())
    async for delta in deltas:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
        if delta.token_ids:
            now = time.perf_counter()
            summary.first_token = summary.first_token or now
            summary.last_token = now
            summary.tokens += len(delta.token_ids)
        summary.finish_reason = delta.finish_reason or summary.finish_reason
    sys.stdout.write("\n")
    sys.stdout.flush()
    return summary


def _report(args, summary: Summary, stats: dict | None) -> None:
    if not args.quiet:
        print(summary.line(args.max_tokens), file=sys.stderr)
    if stats is not None:
        print(stats, file=sys.stderr)

"""Tokenizing a prompt without stalling the event loop.

A prompt's length is capped before it is tokenized (tokenizing 1 MB takes about a second), and a
long prompt is tokenized on a worker thread: the loop goes on ticking and streaming meanwhile (the
Rust tokenizer releases the GIL; a pure-Python one still yields it every switch interval). Short
prompts stay on the loop, where a thread hop would cost more than the encode.
"""
from __future__ import annotations

import asyncio

from slipstream.errors import InvalidRequestError

INLINE_CHARS = 2048  # below this, encoding takes well under a millisecond


def check_prompt_chars(text: str, limit: int, param: str = "prompt") -> None:
    if len(text) > limit:
        raise InvalidRequestError(f"{param} has {len(text):,} characters; this server takes at most {limit:,} "
                                  "(EngineConfig.max_prompt_chars)", param=param)


async def encode_off_loop(tokenizer, text: str, limit: int, param: str = "prompt") -> list[int]:
    check_prompt_chars(text, limit, param)
    if len(text) <= INLINE_CHARS:
        return tokenizer.encode(text)
    return await asyncio.to_thread(tokenizer.encode, text)

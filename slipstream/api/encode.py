"""Tokenizing a prompt without stalling the event loop.

A prompt's length is capped before it is tokenized (tokenizing 1 MB takes about a second), and a
long prompt is tokenized on a worker thread: the loop goes on ticking and streaming meanwhile (the
Rust tokenizer releases the GIL; a pure-Python one still yields it every switch interval). Short
prompts stay on the loop, where a thread hop would cost more than the encode.
"""
from __future__ import annotations

import asyncio
import functools

from slipstream.errors import InvalidRequestError

INLINE_CHARS = 2048  # below this, encoding takes well under a millisecond


def check_prompt_chars(text: str, limit: int, param: str = "prompt") -> None:
    if len(text) > limit:
        raise InvalidRequestError(f"{param} has {len(text):,} characters; this server takes at most {limit:,} "
                                  "(EngineConfig.max_prompt_chars)", param=param)


async def encode_off_loop(tokenizer, text: str, limit: int, param: str = "prompt", chat: bool = False) -> list[int]:
    """`chat`: `text` is a rendered chat template, tokenized as transformers' apply_chat_template
    tokenizes it: without the tokenizer's own special tokens (the template writes the BOS it wants;
    Gemma's and Mistral's tokenizers would prepend a second one)."""
    check_prompt_chars(text, limit, param)
    encode = functools.partial(tokenizer.encode, add_special_tokens=False) if chat else tokenizer.encode
    if len(text) <= INLINE_CHARS:
        return encode(text)
    return await asyncio.to_thread(encode, text)

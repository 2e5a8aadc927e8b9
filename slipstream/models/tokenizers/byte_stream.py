"""Streaming detokenisation for tokenizers whose decode is the concatenation of their tokens' bytes.

The general IncrementalDetokenizer (tokenizer.py) decodes a short window of ids twice per push,
because for some decoders (SentencePiece's leading-space rule) a token's text depends on its
neighbours. A byte-level vocabulary (GPT-2 style BPE: SmolLM2, Llama 3, Qwen2; the test models'
ByteTokenizer) has no such rule: decode(ids) is the UTF-8 decoding of the tokens' bytes joined.
Then one table lookup and an incremental UTF-8 decoder per token give the same text, at a fraction
of the cost (two window decodes per token were the output stage's largest item at 512 streams).

Same contract as IncrementalDetokenizer: the deltas concatenate to
`tokenizer.decode(output_ids, skip_special_tokens=True)` less a character cut at the end; bytes of
an unfinished character are held back until it completes, and `flush()` drops them. (An invalid
byte sequence shows its U+FFFD as soon as the decoder knows it is invalid; the window decoder
showed it one token later. The text is the same.)
"""
from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence
from typing import Any

import structlog

from slipstream.models.tokenizers.utf8_tail import token_bytes_of

log = structlog.get_logger(__name__)

_TABLES: "weakref.WeakKeyDictionary[Any, list[bytes] | None]" = weakref.WeakKeyDictionary()


def byte_table(tokenizer: Any) -> list[bytes] | None:
    """Each id's bytes in decoded output (b"" for special tokens), or None when the tokenizer's decode
    is not a plain concatenation of bytes. Built once per tokenizer and checked against its decode."""
    try:
        if tokenizer in _TABLES:
            return _TABLES[tokenizer]
    except TypeError:  # a tokenizer object that cannot be weakly referenced or hashed: no fast path
        return None
    try:
        table = _build(tokenizer)
    except Exception as e:  # noqa: BLE001 - an unusual tokenizer keeps the window detokenizer
        log.warning("byte_stream_detokenizer_unavailable", effect="window detokenizer", error=repr(e))
        table = None
    _TABLES[tokenizer] = table
    return table


def _build(tokenizer: Any) -> list[bytes] | None:
    if getattr(tokenizer, "decodes_by_bytes", False):  # ByteTokenizer says so itself
        token_bytes = tokenizer.token_bytes
    else:
        backend = getattr(tokenizer, "backend", None)
        decoder = getattr(backend, "decoder", None)
        if decoder is None or type(decoder).__name__ != "ByteLevel":  # Sequence/SentencePiece: window path
            return None
        token_bytes = token_bytes_of(tokenizer)
        if token_bytes is None:
            return None
    table = [token_bytes(i) for i in range(tokenizer.vocab_size)]
    # Added tokens are where a backend may differ from the byte rule: check each against decode.
    added: dict = getattr(getattr(tokenizer, "backend", None), "get_added_tokens_decoder", dict)()
    for i in added:
        if i >= len(table) or table[i].decode("utf-8", "replace") != tokenizer.decode([i], skip_special_tokens=True):
            return None
    return table


class ByteStreamDetokenizer:
    """IncrementalDetokenizer's push / flush over a byte table."""

    def __init__(self, table: list[bytes]) -> None:
        self._table, self._n = table, len(table)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._decode = self._utf8.decode

    def push(self, token_ids: Sequence[int]) -> str:
        table, n = self._table, self._n
        if len(token_ids) == 1:  # a pass per step: one token (ids >= 0, validated upstream)
            i = token_ids[0]
            data = table[i] if i < n else b""
        else:
            data = b"".join([table[i] if i < n else b"" for i in token_ids])
        return self._decode(data) if data else ""

    def flush(self) -> str:
        """Nothing is pending but the bytes of an unfinished character, which are dropped."""
        self._utf8.reset()
        return ""


def make_detokenizer(tokenizer: Any, prompt_ids: Sequence[int] | None = None):
    """The fast byte-stream detokenizer where the tokenizer allows it, else the window one."""
    table = byte_table(tokenizer)
    if table is not None:
        return ByteStreamDetokenizer(table)
    from slipstream.models.tokenizers.tokenizer import IncrementalDetokenizer

    return IncrementalDetokenizer(tokenizer, prompt_ids)

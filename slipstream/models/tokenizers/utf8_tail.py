"""The end of an output cut inside a multi-byte character: drop the incomplete bytes, not show '\ufffd'.

A stream that stops at max_tokens (or an abort) can stop between the bytes of one character
(byte-level vocabularies spell an emoji in up to four tokens). Decoding that tail gives U+FFFD,
which no user wants to see. Looking at decoded text cannot tell it from a U+FFFD the model spelled
out in full (bytes EF BF BD), so the decision is made on the tokens' bytes: only a trailing
sequence that is a valid but unfinished UTF-8 prefix is dropped.
"""
from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

TokenBytes = Callable[[int], bytes]
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback tokens
_SPM_SPACE = "\u2581"


def token_bytes_of(tokenizer: Any) -> TokenBytes | None:
    """id -> the bytes it stands for in decoded output, or None when the tokenizer cannot say.

    A tokenizer may provide `token_bytes(id)` itself (ByteTokenizer); a `tokenizers` backend is
    understood when its decoder is byte-level (GPT-2 alphabet) or uses byte fallback (SentencePiece).
    Other decoders never produce partial characters, so None (nothing to drop) is then correct.
    """
    own = getattr(tokenizer, "token_bytes", None)
    if own is not None:
        return own
    backend: Any = getattr(tokenizer, "backend", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    state = json.loads(decoder.__getstate__())
    kinds = {state.get("type")} | {d.get("type") for d in state.get("decoders", [])}
    added = {i: (t.content, t.special) for i, t in backend.get_added_tokens_decoder().items()}

    def text_of_added(i: int) -> bytes | None:
        if i not in added:
            return None
        content, special = added[i]
        return b"" if special else content.encode("utf-8")  # special tokens are skipped in output

    if "ByteLevel" in kinds:
        from slipstream.models.tokenizers.byte_bpe import byte_alphabet

        byte_of = {c: b for b, c in byte_alphabet().items()}

        def byte_level(i: int) -> bytes:
            known = text_of_added(i)
            if known is not None:
                return known
            spelled = backend.id_to_token(i) or ""
            return bytes(byte_of[c] for c in spelled) if all(c in byte_of for c in spelled) else spelled.encode()

        return byte_level
    if "ByteFallback" in kinds:
        def byte_fallback(i: int) -> bytes:
            known = text_of_added(i)
            if known is not None:
                return known
            spelled = backend.id_to_token(i) or ""
            m = BYTE_PIECE.fullmatch(spelled)
            return bytes([int(m.group(1), 16)]) if m else spelled.replace(_SPM_SPACE, " ").encode()

        return byte_fallback
    return None


def drop_incomplete_char(tokenizer: Any, ids: Sequence[int], text: str) -> str:
    """`text`, the decode of `ids` (which start on a character boundary), without a character cut
    at the end. Unchanged unless the ids' bytes end in an unfinished UTF-8 sequence."""
    if not text.endswith("\ufffd"):
        return text
    token_bytes = token_bytes_of(tokenizer)
    if token_bytes is None:
        return text
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    complete = decoder.decode(b"".join(token_bytes(int(i)) for i in ids), final=False)
    unfinished, _ = decoder.getstate()
    return complete if unfinished else text

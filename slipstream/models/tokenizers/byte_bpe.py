"""Byte-level BPE vocabularies (GPT-2 style: SmolLM, Llama-3, Qwen2) from GGUF metadata.

Tokens are spelled in GPT-2's reversible byte alphabet; the pre-tokenizer must be the split rule the
merges were learned with (`tokenizer.ggml.pre`), or token ids silently change.
"""
from __future__ import annotations

from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from slipstream.errors import CorruptModelError

# llama.cpp's `tokenizer.ggml.pre` names whose split rule is not plain GPT-2 byte-level.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRES = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"}
# Qwen2's rule: Llama-3's, except that every digit stands alone.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PRES = {"qwen2", "deepseek-r1-qwen"}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table; byte-level vocabularies are spelled in it."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str | None, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    """The split rule the merges were learned with; a mismatch silently changes token ids."""
    if pre == "smollm":
        # SmolLM's own tokenizer.json (and llama.cpp's "smollm" rule) isolate every digit first.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
            ]
        )
    if pre in _LLAMA3_PRES or pre in _QWEN2_PRES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre in _LLAMA3_PRES else _QWEN2_SPLIT),
                                     behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)


def byte_level_backend(fields: dict[str, Any], source: str) -> tuple[_HFTokenizer, list[str], list[int]]:
    """Byte-level BPE from GGUF tokens + merges; returns the backend, the tokens and their types."""
    tokens: list[str] = list(fields.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise CorruptModelError(f"{source}: no tokenizer.ggml.tokens in the metadata")
    types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    # A token stored with characters outside the byte alphabet is re-spelled byte by byte, since
    # BPE only ever sees byte-alphabet text (llama.cpp sometimes stores such tokens raw).
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        key = tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(key, i)
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    add_prefix_space = bool(fields.get("tokenizer.ggml.add_space_prefix", False))
    backend.pre_tokenizer = _pre_tokenizer(fields.get("tokenizer.ggml.pre"), add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    return backend, tokens, types

"""SentencePiece-BPE vocabularies from GGUF metadata (`tokenizer.ggml.model == "llama"`).

Llama-2, TinyLlama, Mistral and friends ship a SentencePiece BPE model. A GGUF stores it as tokens,
scores and token types, without merges. SentencePiece's BPE merges, at every step, the adjacent pair
whose concatenation is the highest-scoring vocabulary entry, so a merge list ordered by the merged
token's score reproduces it with the `tokenizers` BPE model. Spaces become U+2581 ("▁"), a leading one
is prepended to the text when the file asks for it (llama.cpp's default), and characters missing from
the vocabulary fall back to their UTF-8 bytes (the `<0xAB>` tokens).
"""
from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from slipstream.errors import CorruptModelError

SPACE = "\u2581"
# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a mergeable token into two vocabulary entries, best-scoring token first.

    Ties (equal scores) put the longer left piece first, then vocabulary order: deterministic, and
    the order transformers' GGUF converter arrives at, so both tokenizers agree even on ties.
    """
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}  # first occurrence wins
    candidates: list[tuple[float, int, int, int, str, str]] = []
    for i, (tok, score, ty) in enumerate(zip(tokens, scores, types)):
        if ty not in (NORMAL, USER_DEFINED) or len(tok) < 2 or vocab.get(tok) != i:
            continue
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in vocab and right in vocab:
                candidates.append((-float(score), -len(left), -len(right), i, left, right))
    candidates.sort(key=lambda c: c[:4])
    return [(c[4], c[5]) for c in candidates]


def spm_backend(fields: dict[str, Any], source: str) -> tuple[_HFTokenizer, list[str], list[int]]:
    """A `tokenizers.Tokenizer` equivalent to the SentencePiece model described by `fields`.

    Returns the backend plus the token list and types (the caller adds special tokens and BOS).
    """
    tokens: list[str] = list(fields.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise CorruptModelError(f"{source}: no tokenizer.ggml.tokens in the metadata")
    scores = list(fields.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise CorruptModelError(f"{source}: tokenizer.ggml.scores has {len(scores)} entries for "
                                f"{len(tokens)} tokens (a SentencePiece vocabulary needs one per token)")
    types = list(fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    unk_id = fields.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else next(
        (t for t, ty in zip(tokens, types) if ty == UNKNOWN), None)
    backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges_from_scores(tokens, scores, types), unk_token=unk,
                                      fuse_unk=True, byte_fallback=True))
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    # "first": only the start of the text gets the prefix, not every piece between special tokens.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first" if prefix else "never",
                                                     split=False)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))  # drop the prepended space again
    backend.decoder = decoders.Sequence(steps)
    return backend, tokens, types

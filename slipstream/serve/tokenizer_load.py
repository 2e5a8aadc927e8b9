"""The tokenizer of a model spec without its weights (the --connect front end needs only this)."""
from __future__ import annotations

from typing import Any


def load_tokenizer(spec: str) -> tuple[Any, int]:
    """(tokenizer, vocabulary size) for the spec a worker reports it serves."""
    from slipstream.models.llama.build import RANDOM

    if spec in RANDOM:
        from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer

        vocab = RANDOM[spec]().vocab_size
        return ByteTokenizer(vocab), vocab
    from slipstream.models.loading.loader import resolve_model_path
    from slipstream.models.tokenizers.tokenizer import Tokenizer

    path = resolve_model_path(spec)
    if path.is_dir():
        tok = Tokenizer.from_file(path / "tokenizer.json")
    else:
        from slipstream.models.loading.gguf_loader import load_gguf_tokenizer

        tok = load_gguf_tokenizer(path)
    return tok, tok.vocab_size

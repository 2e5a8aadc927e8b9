"""What each token id spells, learned once per tokenizer and shared by every grammar built on it.

Grammars that work on text (the spatial skills, plugins) need to know which ids spell "0".."9" or a
separator. That is read from the tokenizer itself at load time by decoding each id alone, so any
tokenizer works: byte-level BPE spells a space as "Ġ" in its vocabulary but decodes it to " ".
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

from slipstream.errors import GrammarCompileError


class TokenTable:
    """Decoded text of every id of one tokenizer, plus lookups by exact text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.eos_ids: tuple[int, ...] = tuple(int(i) for i in (getattr(tokenizer, "eos_token_ids", ()) or ()))
        texts: list[str] = []
        for i in range(self.vocab_size):
            try:
                texts.append(tokenizer.decode([i]))
            except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode spells nothing
                texts.append("")
        self.texts = texts
        eos = set(self.eos_ids)
        self._by_text: dict[str, list[int]] = {}
        for i, t in enumerate(texts):
            if t and i not in eos:
                self._by_text.setdefault(t, []).append(i)

    def ids_of(self, text: str) -> list[int]:
        """Every non-EOS id that decodes to exactly `text` (often one; byte fallbacks can add more)."""
        return list(self._by_text.get(text, ()))

    def require(self, text: str, what: str) -> list[int]:
        """`ids_of(text)`, or GrammarCompileError naming the missing token."""
        ids = self.ids_of(text)
        if not ids:
            raise GrammarCompileError(f"{what}: the tokenizer has no single token for {text!r}")
        return ids

    def text(self, token: int) -> str:
        return self.texts[token] if 0 <= token < self.vocab_size else ""


_tables: weakref.WeakKeyDictionary[Any, TokenTable] = weakref.WeakKeyDictionary()
_by_id: dict[int, tuple[Any, TokenTable]] = {}  # tokenizers that cannot be weakly referenced
_lock = threading.Lock()


def token_table(tokenizer: Any) -> TokenTable:
    """The (cached) TokenTable of `tokenizer`; the first call decodes the whole vocabulary (~0.1 s)."""
    with _lock:
        try:
            table = _tables.get(tokenizer)
        except TypeError:
            entry = _by_id.get(id(tokenizer))
            table = entry[1] if entry is not None and entry[0] is tokenizer else None
        if table is None:
            table = TokenTable(tokenizer)
            try:
                _tables[tokenizer] = table
            except TypeError:
                _by_id[id(tokenizer)] = (tokenizer, table)
        return table

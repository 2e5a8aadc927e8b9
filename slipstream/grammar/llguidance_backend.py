"""JSON schema, regex and choice-list grammars, matched by llguidance (MIT, CPU, no torch needed).

The llguidance tokenizer is built once per slipstream tokenizer and cached:

* a `slipstream.models.tokenizers.tokenizer.Tokenizer` (or a bare `tokenizers.Tokenizer`) is handed over as its
  tokenizer.json text (`backend.to_str()`), which llguidance reads natively when its decoder is
  byte-level or byte-fallback;
* any other `tokenizers` decoder (the tiny Idefics3's Fuse, Metaspace, none: llguidance "can't
  determine decoder type") is described token by token through `llguidance.TokenizerWrapper`: each
  id's bytes as it decodes after a plain character (so a leading space a decoder drops at the start
  of a text is kept), special tokens as specials (issue 37);
* the test `ByteTokenizer` (ids 3..258 = bytes 0..255) is described byte by byte the same way; its
  other ids become special tokens that never match text;
* anything else is refused with GrammarCompileError.

Each compiled grammar keeps one `LLMatcher` as a template; a sequence's matcher is a deep copy, so the
grammar is analysed once per spec, never on the engine tick. JSON output defaults to a fixed layout
(", " and ": " separators, no free whitespace), so a small model cannot loop on whitespace; a schema
may override that through llguidance's "x-guidance" key.
"""
from __future__ import annotations

import json
import threading
import weakref
from typing import Any, cast

import numpy as np

from slipstream.errors import GrammarCompileError, GrammarMatchError
from slipstream.grammar.base import GrammarSpec
from slipstream.grammar.bitmask import clear_from, words_for

LLGUIDANCE_KINDS = ("json_schema", "regex", "choice", "tool_calls")

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_lltoks: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_lltok_lock = threading.Lock()


class _TokenBytes:
    """The duck-typed tokenizer `llguidance.TokenizerWrapper` reads: every id's bytes, the special
    ids, and an encoder of text. It holds no reference to the slipstream tokenizer (the weak key of
    the cache)."""

    def __init__(self, tokens: list[bytes], special: list[int], eos: int, bos: int | None, encode) -> None:
        self.tokens, self.special_token_ids = tokens, special
        self.eos_token_id, self.bos_token_id = eos, bos
        self._encode = encode

    def __call__(self, s: bytes | str) -> list[int]:
        return self._encode(s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s)

    @classmethod
    def of_bytes(cls, tokenizer: Any) -> _TokenBytes:
        """The byte-level test tokenizer: ids OFFSET.. are the bytes 0..255, the rest special."""
        from slipstream.models.tokenizers.byte_tokenizer import OFFSET

        n = int(tokenizer.vocab_size)
        tokens = [bytes([i - OFFSET]) if OFFSET <= i < OFFSET + 256 else f"<|special_{i}|>".encode() for i in range(n)]
        special = [i for i in range(n) if not OFFSET <= i < OFFSET + 256]
        return cls(tokens, special, tokenizer.eos_token_ids[0], tokenizer.bos_token_id,
                   lambda text: [b + OFFSET for b in text.encode("utf-8")])

    @classmethod
    def of_hf(cls, tokenizer: Any, backend: Any, n: int, eos: int) -> _TokenBytes:
        """A `tokenizers` backend whose decoder llguidance cannot read: each id as it decodes after
        a plain character (byte-level and byte-fallback vocabularies keep their exact bytes)."""
        from slipstream.models.tokenizers.utf8_tail import BYTE_PIECE, token_bytes_of

        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special and i < n}
        exact = token_bytes_of(tokenizer) if hasattr(tokenizer, "backend") else None
        anchor = backend.token_to_id("a")
        head = backend.decode([anchor]) if anchor is not None else ""
        tokens = []
        for i in range(n):
            if i in special:
                tokens.append((backend.id_to_token(i) or f"<|special_{i}|>").encode())
            elif exact is not None:
                tokens.append(exact(i))
            elif m := BYTE_PIECE.fullmatch(backend.id_to_token(i) or ""):  # byte fallback, any decoder
                tokens.append(bytes([int(m.group(1), 16)]))
            else:
                text = backend.decode([anchor, i]) if anchor is not None else ""
                text = text[len(head):] if anchor is not None and text.startswith(head) else backend.decode([i])
                tokens.append(text.encode("utf-8"))
        return cls(tokens, sorted(special), eos, getattr(tokenizer, "bos_token_id", None),
                   lambda text: backend.encode(text, add_special_tokens=False).ids)


def _build_lltokenizer(tokenizer: Any) -> Any:
    import llguidance
    from tokenizers import Tokenizer as HFTokenizer

    from slipstream.models.tokenizers.byte_tokenizer import ByteTokenizer

    eos = [int(i) for i in (getattr(tokenizer, "eos_token_ids", ()) or ())]
    if not eos:
        raise GrammarCompileError("llguidance grammars need a tokenizer with an EOS token")
    n_vocab = int(tokenizer.vocab_size)
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes.of_bytes(tokenizer)), n_vocab=n_vocab,
                                      eos_token=eos)
    backend = tokenizer if isinstance(tokenizer, HFTokenizer) else getattr(tokenizer, "backend", None)
    if not isinstance(backend, HFTokenizer):
        raise GrammarCompileError(
            f"llguidance grammars need a Hugging Face `tokenizers` tokenizer or the byte tokenizer, "
            f"not {type(tokenizer).__name__}"
        )
    try:
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)
    except ValueError:  # a tokenizer.json llguidance cannot read ("can't determine decoder type"): token by token
        pass
    wrapper = _TokenBytes.of_hf(tokenizer, backend, n_vocab, eos[0])
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper), n_vocab=n_vocab, eos_token=eos)


def ll_tokenizer(tokenizer: Any) -> Any:
    """The cached `llguidance.LLTokenizer` for `tokenizer` (~0.2 s to build for a 49k vocabulary)."""
    with _lltok_lock:
        lltok = _lltoks.get(tokenizer)
        if lltok is None:
            try:
                lltok = _build_lltokenizer(tokenizer)
            except GrammarCompileError:
                raise
            except Exception as e:  # noqa: BLE001 - llguidance rejects some tokenizer.json variants
                raise GrammarCompileError(f"llguidance cannot use this tokenizer: {type(e).__name__}: {e}") from e
            _lltoks[tokenizer] = lltok
        return lltok


def _regex_literal(text: str) -> str:
    """`text` as a regex matching exactly itself: ASCII letters/digits kept, everything else \\x{..}."""
    return "".join(c if (c.isascii() and c.isalnum()) else f"\\x{{{ord(c):x}}}" for c in text)


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar (its JSON form) for a json_schema / regex / choice / tool_calls spec."""
    import llguidance

    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except ValueError as e:
            raise GrammarCompileError(f"invalid JSON schema: not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarCompileError(f"invalid JSON schema: expected an object, got {type(schema).__name__}")
        try:
            # (a bool schema is JSON Schema's true / false; the options are llguidance's JsonCompileOptions)
            return llguidance.LLMatcher.grammar_from_json_schema(cast(Any, schema), defaults=cast(Any, JSON_DEFAULTS))
        except (ValueError, TypeError) as e:
            raise GrammarCompileError(f"invalid JSON schema: {e}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except ValueError as e:
            raise GrammarCompileError(f"invalid choice list: not valid JSON ({e})") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarCompileError("invalid choice list: expected a non-empty JSON list of strings")
        alternatives = "|".join(f"(?:{_regex_literal(c)})" for c in dict.fromkeys(choices))
        return llguidance.LLMatcher.grammar_from_regex(alternatives)
    if spec.kind == "tool_calls":
        from slipstream.grammar.tool_calls import tool_call_source

        return llguidance.LLMatcher.grammar_from_lark(tool_call_source(spec.value))
    raise GrammarCompileError(f"llguidance does not handle grammar kind {spec.kind!r}")


_ERROR_PREFIX = {"json_schema": "invalid JSON schema", "regex": "invalid regex", "choice": "invalid choice list",
                 "tool_calls": "invalid tools"}


class LLGuidanceGrammar:
    """One compiled llguidance grammar; `matcher()` deep-copies a ready template matcher."""

    def __init__(self, spec: GrammarSpec, tokenizer: Any, vocab_size: int) -> None:
        import llguidance

        self.kind = spec.kind
        self.tokenizer = tokenizer
        self.lltok = ll_tokenizer(tokenizer)
        source = grammar_source(spec)
        limits = llguidance.LLParserLimits(verbose_errors=False)  # no parser-state dumps in user errors
        template = llguidance.LLMatcher(self.lltok, source, log_level=0, limits=limits)
        if template.is_error():
            detail = _first_line(template.get_error())
            if spec.kind in ("regex", "choice"):
                detail += f" (in {spec.value!r})"
            raise GrammarCompileError(f"{_ERROR_PREFIX[spec.kind]}: {detail}")
        self._template = template
        self.words = words_for(vocab_size)
        self.ll_words = words_for(self.lltok.vocab_size)
        self.limit = min(vocab_size, self.lltok.vocab_size)  # ids from here on stay disallowed
        self.eos_ids = frozenset(self.lltok.eos_tokens)

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self, self._template.deep_copy())

    def token_text(self, token: int) -> str:
        try:
            return self.tokenizer.decode([int(token)])
        except Exception:  # noqa: BLE001 - only used in error messages
            return "?"


class LLGuidanceMatcher:
    depends_on_previous_token = True

    def __init__(self, grammar: LLGuidanceGrammar, m: Any) -> None:
        self.g = grammar
        self._m = m
        self._trailing_eos = 0  # EOS tokens accepted after the matcher stopped (llguidance does not count them)

    def fill_bitmask(self, row: np.ndarray) -> None:
        m, g = self._m, self.g
        if m.is_error():
            raise GrammarMatchError(f"{g.kind} grammar: {_first_line(m.get_error())}")
        n = g.ll_words
        if row.dtype == np.int32 and row.ndim == 1 and row.flags["C_CONTIGUOUS"] and row.shape[0] >= n:
            m.unsafe_compute_mask_ptr(row.ctypes.data, 4 * n)
            row[n:] = 0
        else:
            tmp = np.zeros(n, dtype=np.int32)
            m.unsafe_compute_mask_ptr(tmp.ctypes.data, 4 * n)
            k = min(n, row.shape[0])
            row[:k] = tmp[:k]
            row[k:] = 0
        if m.is_error():
            raise GrammarMatchError(f"{g.kind} grammar: {_first_line(m.get_error())}")
        if g.limit < 32 * row.shape[0]:
            clear_from(row, g.limit)

    def accept(self, token: int) -> None:
        m, g = self._m, self.g
        token = int(token)
        if token in g.eos_ids and m.is_stopped() and not m.is_error():
            self._trailing_eos += 1
            return
        if self._trailing_eos or m.try_consume_tokens([token]) != 1:
            detail = f": {_first_line(m.get_error())}" if m.is_error() else ""
            raise GrammarMatchError(
                f"{g.kind} grammar: token {token} ({g.token_text(token)!r}) is not allowed here{detail}"
            )

    def is_terminated(self) -> bool:
        return self._m.is_stopped() and not self._m.is_error()

    def rollback(self, n: int) -> None:
        k = min(n, self._trailing_eos)
        self._trailing_eos -= k
        if n - k and not self._m.rollback(n - k):
            raise GrammarMatchError(f"{self.g.kind} grammar: cannot roll back {n} tokens")


def _first_line(msg: str) -> str:
    """The gist of an llguidance error: its "error: ..." line if it has one, else its first line."""
    lines = (msg or "unknown error").strip().splitlines() or ["unknown error"]
    for line in lines:
        if line.startswith("error: "):
            return line[len("error: "):].strip()
    return lines[0].strip()


def build_llguidance(spec: GrammarSpec, tokenizer: Any, vocab_size: int) -> LLGuidanceGrammar:
    """Registry factory for json_schema / regex / choice / tool_calls."""
    return LLGuidanceGrammar(spec, tokenizer, vocab_size)

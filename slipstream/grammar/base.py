"""The grammar plugin interface: specs, compiled grammars, per-sequence matchers, and the compiler.

A `GrammarSpec` names what the output must look like. A `GrammarCompiler` (one per engine) turns it
into a `Grammar` once per spec, off the engine tick and under a timeout, and caches it. Each sequence
gets its own `Matcher` from the shared grammar; the engine asks it for a packed bitmask row before
sampling and tells it every committed token.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import OrderedDict
from typing import Any, Protocol, runtime_checkable

import msgspec
import numpy as np

from slipstream.errors import GrammarCompileError, GrammarError, GrammarTimeoutError


class GrammarSpec(msgspec.Struct, frozen=True):
    """What a request's output must match; hashable, so it is the compile-cache key."""

    kind: str  # "json_schema" | "regex" | "choice" | "point" | "detect" | "segment" | a plugin name
    value: str = ""  # schema JSON text / regex / choice list as JSON text / object name for skills
    max_objects: int = 16


@runtime_checkable
class Matcher(Protocol):
    """Per-sequence state of one grammar. Called from the engine loop's thread only."""

    depends_on_previous_token: bool  # True: the mask for step t+1 needs token t committed

    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the allowed set for the next token into `row` (int32, words_for(V) words).

        Bit j of word i allows token 32*i + j. Must write only `row`, and must leave ids at or past
        the tokenizer's vocabulary (logits padding) at 0.
        """
        ...

    def accept(self, token: int) -> None:
        """Advance by one committed token; GrammarMatchError (state unchanged) if it is not allowed."""
        ...

    def is_terminated(self) -> bool:
        """True once the output is complete: nothing but EOS may follow (the engine stops with "stop")."""
        ...

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens; NotImplementedError if the matcher cannot."""
        ...


@runtime_checkable
class Grammar(Protocol):
    """A compiled grammar, built once per (spec, tokenizer) and shared by all sequences using it."""

    def matcher(self) -> Matcher:
        ...


class GrammarCompiler:
    """Compiles specs to grammars for one tokenizer and logits width; one per engine.

    Compilation runs on a fresh daemon thread per cache miss, so a grammar that never finishes
    compiling cannot hold up any other (a stuck compile only costs its thread; later requests for the
    same spec wait on the same attempt instead of starting another). Successful grammars are kept in
    an LRU cache keyed by spec; failed compiles are not cached.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float = 10.0, cache_size: int = 256) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)  # logits width V, padding columns included
        self.timeout_s = float(timeout_s)
        self.cache_size = int(cache_size)
        self._cache: OrderedDict[GrammarSpec, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()

    # --- public ----------------------------------------------------------------------------

    def compile(self, spec: GrammarSpec) -> Grammar:
        """Blocking compile (cached by spec). Raises GrammarCompileError or GrammarTimeoutError."""
        fut = self._future(spec)
        try:
            return fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timeout(spec) from None

    async def compile_async(self, spec: GrammarSpec) -> Grammar:
        """`compile` without blocking the event loop: the work runs on a thread, under the timeout."""
        fut = self._future(spec)
        try:
            # shield: a timed-out or cancelled waiter must not cancel the shared attempt
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._timeout(spec) from None

    def cached(self, spec: GrammarSpec) -> bool:
        """Whether a successful compile of `spec` is in the cache."""
        with self._lock:
            fut = self._cache.get(_cache_key(spec))
        return fut is not None and fut.done() and fut.exception() is None

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    # --- internals -------------------------------------------------------------------------

    def _timeout(self, spec: GrammarSpec) -> GrammarTimeoutError:
        return GrammarTimeoutError(
            f"compiling the {spec.kind!r} grammar timed out after {self.timeout_s:g} s"
        )

    def _future(self, spec: GrammarSpec) -> concurrent.futures.Future:
        if not isinstance(spec, GrammarSpec):
            raise GrammarCompileError(f"expected a GrammarSpec, got {type(spec).__name__}")
        _check_spec(spec)
        key = _cache_key(spec)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = concurrent.futures.Future()
            fut.set_running_or_notify_cancel()
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        threading.Thread(target=self._run, args=(spec, key, fut), name=f"grammar-compile-{spec.kind}",
                         daemon=True).start()
        return fut

    def _run(self, spec: GrammarSpec, key: GrammarSpec, fut: concurrent.futures.Future) -> None:
        try:
            grammar = self._build(spec)
        except BaseException as e:  # noqa: BLE001 - every failure goes to the waiters
            with self._lock:
                if self._cache.get(key) is fut:
                    del self._cache[key]
            fut.set_exception(e)
        else:
            fut.set_result(grammar)

    def _build(self, spec: GrammarSpec) -> Grammar:
        from slipstream.grammar.registry import build_grammar

        try:
            return build_grammar(spec, self.tokenizer, self.vocab_size)
        except GrammarError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug in a built-in must still fail only its request
            raise GrammarCompileError(f"{spec.kind} grammar failed to compile: {type(e).__name__}: {e}") from e


def _check_spec(spec: GrammarSpec) -> None:
    """Field types (msgspec does not check them on construction); raised before any cache lookup."""
    if not isinstance(spec.kind, str) or not spec.kind:
        raise GrammarCompileError(f"grammar kind must be a non-empty string, got {spec.kind!r}")
    if not isinstance(spec.value, str):
        raise GrammarCompileError(f"grammar value must be a string, got {type(spec.value).__name__}")
    if isinstance(spec.max_objects, bool) or not isinstance(spec.max_objects, int) or spec.max_objects < 0:
        raise GrammarCompileError(f"max_objects must be an integer >= 0, got {spec.max_objects!r}")


_SKILL_KINDS = frozenset({"point", "detect", "segment"})


def _cache_key(spec: GrammarSpec) -> GrammarSpec:
    """Skills ignore the object name (it only shapes the prompt): one grammar per (kind, max_objects)."""
    if spec.kind in _SKILL_KINDS and spec.value:
        return GrammarSpec(spec.kind, "", spec.max_objects)
    return spec

"""The grammar compiler: a spec to a `Grammar`, once per spec, off the engine tick, under a timeout.

Apart from base.py because it builds grammars through the registry (registry.py), which itself
imports base.py's types: one module holding both made an import circle.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import OrderedDict
from typing import Any, Callable, Mapping

from slipstream.errors import GrammarCompileError, GrammarError, GrammarTimeoutError
from slipstream.grammar.base import Grammar, GrammarSpec
from slipstream.grammar.registry import build_grammar


class GrammarCompiler:
    """Compiles specs to grammars for one tokenizer and logits width; one per engine.

    Compilation runs on a fresh daemon thread per cache miss, so a grammar that never finishes
    compiling cannot hold up any other (a stuck compile only costs its thread; later requests for the
    same spec wait on the same attempt instead of starting another). Successful grammars are kept in
    an LRU cache keyed by spec; failed compiles are not cached.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float = 10.0, cache_size: int = 256,
                 factories: Mapping[str, Callable] | None = None) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)  # logits width V, padding columns included
        self.timeout_s = float(timeout_s)
        self.cache_size = int(cache_size)
        # this engine's own factories for some kinds (a model with region heads: point/detect)
        self.factories = dict(factories or {})
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
        try:
            factory = self.factories.get(spec.kind)
            if factory is not None:
                return factory(spec, self.tokenizer, self.vocab_size)
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

"""Keeping the cycle collector off the heap that exists before the first engine builds its parts.

A full (generation-2) collection walks every tracked object: with torch, transformers and the
model loaded that is ~190–200k objects and ~0.1 s of CPU per collection, paid inside a serving step
(`tools/bench/bench_gc.py`; docs/benchmarks.md). Most of them are the libraries' (modules, functions,
classes), which live as long as the process, so the first engine's start `gc.freeze()`s what exists
before it builds anything; collections then walk the engines' own objects and what serving creates.

CPython freezes and unfreezes all or nothing (no per-object unfreeze), which sets the rules:
  * Only what exists before an engine is frozen: no engine's objects (its loop, runner, KV cache)
    are ever frozen, so a closed engine is freed while another runs. A later engine's start does
    not freeze again (that would freeze the running engines).
  * The freeze is taken only when nothing is frozen: an application that froze its own heap (a
    pre-fork server) keeps its freeze as it made it, and the engine adds nothing to it.
  * The last engine to stop unfreezes, only if the engines froze, and only if the frozen set did
    not grow meanwhile (the application froze too: its freeze would go with ours). Frozen objects
    that die leave the set, so an application freezing fewer objects than died goes unnoticed.
EngineConfig(freeze_gc=False) opts an engine out; it still counts as running (no freeze while it runs).
"""
from __future__ import annotations

import gc
import threading
import time

import structlog

log = structlog.get_logger(__name__)

_running = 0  # engines started and not closed, with or without freeze_gc
_frozen: int | None = None  # objects the engines' freeze took (None: the engines froze nothing)
_lock = threading.Lock()  # engines may start and stop on different threads' loops
COLLECT_FIRST = True  # the test suite turns it off: ~0.15 s per engine start, hundreds of starts


def hold(freeze: bool = True) -> None:
    """An engine starts, before it builds its parts: freeze the heap if it may (see above)."""
    global _running, _frozen
    t0 = time.perf_counter()
    with _lock:
        _running += 1
        if not freeze or _running > 1 or gc.get_freeze_count():
            log.info("gc_freeze_skipped", requested=freeze, engines_running=_running, frozen=gc.get_freeze_count())
            return
        if COLLECT_FIRST:  # garbage frozen now would stay until release()
            gc.collect()
        gc.freeze()
        _frozen = gc.get_freeze_count()
    log.info("gc_frozen", objects=_frozen, seconds=round(time.perf_counter() - t0, 3))


def release() -> None:
    """An engine stopped (one call per hold())."""
    global _running, _frozen
    with _lock:
        if _running == 0:
            return
        _running -= 1
        if _running or _frozen is None:
            return
        ours, _frozen = _frozen, None
        if gc.get_freeze_count() > ours:
            log.info("gc_freeze_kept", reason="objects were frozen since the engine's freeze")
            return
        gc.unfreeze()

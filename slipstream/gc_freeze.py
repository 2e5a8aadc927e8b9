"""Keeping the cycle collector off the heap that exists when an engine starts.

A full (generation-2) collection walks every tracked object: with torch, transformers and the
model loaded that is ~190–200k objects and ~0.1 s of CPU per collection, paid inside a serving step
(`tools/bench_gc.py`; docs/benchmarks.md, "Host-only cost per step (issue 14, session 6)"). What exists at start (modules, the
model, the tokenizer) lives until the engine stops, so `gc.freeze()` moves it out of the
collector's sight; collections then walk only what serving creates.

The cost: an object frozen while alive that later becomes cyclic garbage is not reclaimed while
frozen. So the freeze is held per running engine and undone (`gc.unfreeze()`) when the last
engine of the process stops; objects it kept become collectable then.
EngineConfig(freeze_gc=False) opts out.
"""
from __future__ import annotations

import gc
import threading
import time

import structlog

log = structlog.get_logger(__name__)

_holders = 0
_lock = threading.Lock()  # engines may start and stop on different threads' loops
COLLECT_FIRST = True  # the test suite turns it off: ~0.15 s per engine start, hundreds of starts


def hold() -> None:
    """Collect, then freeze everything alive (also when another engine already holds a freeze:
    this engine's own objects join the frozen set)."""
    global _holders
    t0 = time.perf_counter()
    with _lock:
        if COLLECT_FIRST:  # garbage frozen now would stay until release()
            gc.collect()
        gc.freeze()
        _holders += 1
    log.info("gc_frozen", objects=gc.get_freeze_count(), seconds=round(time.perf_counter() - t0, 3))


def release() -> None:
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()

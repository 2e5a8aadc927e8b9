"""Fault injection for tests and the soak tool: raise (or stall) at named points of the engine.

The engine calls `faults.check(point, key)` only where an injector is installed (the attribute is
None otherwise), so this costs one attribute test when off. Points:
  forward     the model forward of a step, on the compute stream (key: step id)
  sample      sampling of a step's rows, on the compute stream (key: step id)
  matcher     a grammar matcher's mask or accept, on the loop (key: request id)
  detokenize  turning a committed token into text, on the loop (key: request id)
A point fires when armed (`arm(point, times)`, deterministic) or at random with its `rates`
probability (seeded). `stall(point, seconds)` makes the point sleep instead (watchdog tests).
"""
from __future__ import annotations

import random
import threading
import time
from collections import Counter

POINTS = ("forward", "sample", "matcher", "detokenize")


class InjectedFault(Exception):
    """Raised by a FaultInjector; never raised by slipstream itself."""


class FaultInjector:
    def __init__(self, rates: dict[str, float] | None = None, seed: int = 0):
        for point in rates or {}:
            if point not in POINTS:
                raise ValueError(f"unknown fault point {point!r}; expected one of {POINTS}")
        self.rates = dict(rates or {})
        self._rng = random.Random(seed)
        self._armed: Counter[str] = Counter()
        self._stalls: dict[str, float] = {}
        self._lock = threading.Lock()  # forward/sample points run on a stream thread
        self.fired: Counter[str] = Counter()

    def arm(self, point: str, times: int = 1) -> "FaultInjector":
        with self._lock:
            self._armed[point] += times
        return self

    def stall(self, point: str, seconds: float) -> "FaultInjector":
        self._stalls[point] = seconds
        return self

    def check(self, point: str, key: object = None) -> None:
        with self._lock:
            fire = self._armed[point] > 0 or (self.rates.get(point, 0.0) > 0 and self._rng.random() < self.rates[point])
            if fire:
                self._armed[point] = max(self._armed[point] - 1, 0)
                self.fired[point] += 1
            stall = self._stalls.pop(point, 0.0)
        if stall:
            time.sleep(stall)
        if fire:
            raise InjectedFault(f"injected {point} fault (at {key})")


def install(engine, injector: FaultInjector | None) -> None:
    """Put `injector` (or None: off) into a started Engine's runner, output processor and constraints."""
    engine.parts.runner.faults = injector
    engine.loop.outputs.faults = injector
    engine.loop.constraints.faults = injector

"""The watchdog: a launched step that does not complete within its timeout fails the engine.

A step waits on the device; if the device hangs, every request would wait forever. The watchdog
wakes a few times per timeout, looks at the oldest step in flight, and when it has been in flight
longer than the timeout asks the loop to log its state and fail (`EngineLoop.on_stall`), then
cancels the loop task, whose waiters all get an error. It costs nothing per step.
"""
from __future__ import annotations

import asyncio
import time


class Watchdog:
    def __init__(self, loop, timeout_s: float):
        self.loop, self.timeout_s = loop, timeout_s
        self.period_s = min(max(timeout_s / 4, 0.005), 1.0)

    async def run(self, loop_task: asyncio.Task | None) -> None:  # (the loop's task: current_task())
        while True:
            await asyncio.sleep(self.period_s)
            if self._stalled(loop_task):
                return

    def _stalled(self, loop_task: asyncio.Task | None) -> bool:
        # (a function of its own: the step it looks at is not held across the sleep, with the
        # sequences and requests it references, after the step is gone)
        inflight = self.loop.pipeline.inflight
        if not inflight:
            return False
        step = inflight[0]
        waited = time.perf_counter() - step.timings.get("t_launch", time.perf_counter())
        if waited > self.timeout_s:
            self.loop.on_stall(step, waited)
            if loop_task is not None:
                loop_task.cancel()
            return True
        return False

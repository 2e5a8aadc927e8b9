"""An independent prediction of depth 2 from the depth-1 run alone, made before depth 2 runs.

At depth 1 every step is a baton pass: the device runs (busy), then waits while the host commits,
finalizes, plans and launches. At depth 2 the host's work for step t+1 runs while the device runs
step t, so the steady-state period becomes the slower of the two lanes:

    T₂ ≈ max(device busy per step, host time per step)          both measured at depth 1

host time per step = period − commit wait (the host's own time in the step's window: bookkeeping
plus the loop's untraced overhead). Means, not medians: a wall is a sum of periods. Only the
L − 1 decode steps change; the prefill step and the rest of the depth-1 wall are kept as they were:

    wall₂ ≈ wall₁ − (L − 1)(T₁ − T₂)          speedup ≈ wall₁ / wall₂

What it leaves out, by construction: whatever depth 2 itself changes (on the CPU device the
forward shares cores and the GIL with the host, so it slows when the host runs beside it; on a GPU
the host's wake-up and launch costs may differ when the device is already busy). A miss measures
that interaction; the accounting identity in slipstream/bench.py cannot miss it, because it reads
depth 2's own periods.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prediction:
    streams: int
    output_len: int
    busy_ms: float  # depth-1 device busy per step (mean)
    host_ms: float  # depth-1 host time per step (mean of period − commit wait)
    t_block_ms: float  # depth-1 period (mean)
    period_ms: float  # predicted depth-2 period
    wall_s: float  # predicted depth-2 wall
    speedup: float  # predicted wall₁ / wall₂

    @property
    def bound(self) -> str:
        """Which lane the prediction says sets the depth-2 period."""
        return "device" if self.busy_ms >= self.host_ms else "host"


def predict_depth2(depth1) -> Prediction:
    """From a depth-1 RunResult only (slipstream.bench.RunResult); refuses any other depth."""
    if depth1.depth != 1:
        raise ValueError(f"predict_depth2 takes the depth-1 run, got depth {depth1.depth}")
    s = depth1.steady
    t2 = max(s.busy_mean_ms, s.host_mean_ms)
    decode_steps = depth1.output_len - 1
    wall2 = depth1.wall - decode_steps * max(s.period_mean_ms - t2, 0.0) * 1e-3
    return Prediction(depth1.streams, depth1.output_len, s.busy_mean_ms, s.host_mean_ms, s.period_mean_ms, t2,
                      wall2, depth1.wall / wall2)


def disagreement(observed: list[float]) -> str | None:
    """A warning when the repeats spread wider than the effect reported (the median speedup − 1)."""
    if len(observed) < 2:
        return None
    ordered = sorted(observed)
    median = ordered[(len(ordered) - 1) // 2]  # the repeat the tables show
    spread = ordered[-1] - ordered[0]
    if spread <= abs(median - 1.0):
        return None
    return (f"repeats disagree: observed {100 * (ordered[0] - 1):+.1f}% to {100 * (ordered[-1] - 1):+.1f}% "
            f"(spread {100 * spread:.1f} pp) is wider than the effect reported ({100 * (median - 1):+.1f}%)")

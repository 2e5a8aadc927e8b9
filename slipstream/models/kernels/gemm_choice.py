"""Which kernel multiplies a few token rows by a weight: cuBLAS or the split-K GEMV, chosen per shape by measurement.

No threshold decides it: for each weight shape (N, K) and each row count up to a limit, the candidates
(cuBLAS, and the GEMV of gemv_splitk_triton.py at a few column tiles and K splits) are timed on the
device where the model runs, once, at start (before any graph is captured), and the table keeps the
fastest; cuBLAS stays unless a GEMV beats it by more than MARGIN (timing noise must not flip a shape
to the newer kernel). A shape the table does not hold, or a weight with a bias, takes cuBLAS.
"""
from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slipstream.models.kernels.gemv_splitk_triton import MAX_ROWS, gemv_splitk_triton

MARGIN = 0.03  # a GEMV must be this much faster than cuBLAS to be chosen


@dataclass(frozen=True)
class Gemv:
    """The split-K GEMV at one launch configuration."""

    block_n: int
    split: int


CUBLAS = None  # the table's value for "cuBLAS" (F.linear)
CANDIDATES: tuple[Gemv, ...] = (Gemv(4, 1), Gemv(8, 1), Gemv(8, 2), Gemv(8, 4))  # (each compiles at start)
# (rows, N, K) -> the chosen GEMV, or CUBLAS
Table = dict[tuple[int, int, int], Gemv | None]


def pick(timings: dict[Gemv | None, float]) -> Gemv | None:
    """The fastest candidate of `timings` (ms, CUBLAS among them), cuBLAS unless beaten by MARGIN."""
    best = min((c for c in timings if c is not CUBLAS), key=lambda c: timings[c], default=None)
    if best is None or timings[best] >= timings[CUBLAS] * (1 - MARGIN):
        return CUBLAS
    return best


def run(candidate: Gemv | None, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if candidate is CUBLAS:
        return F.linear(x, weight)
    return gemv_splitk_triton(x, weight, block_n=candidate.block_n, split=candidate.split)


def measure(weights: Iterable[torch.Tensor], rows: Iterable[int],
            time_ms: Callable[[Gemv | None, Callable[[], object]], float]) -> Table:
    """The table for these weights (one entry per distinct shape and row count <= MAX_ROWS):
    `time_ms(candidate, fn)` times fn (which runs the candidate on a random input of the shape)."""
    table: Table = {}
    shapes = {(w.shape[0], w.shape[1]): w for w in weights}
    for n_rows in rows:
        if not 1 <= n_rows <= MAX_ROWS:
            raise ValueError(f"row counts must be 1..{MAX_ROWS}, got {n_rows}")
        for (n, k), w in shapes.items():
            x = torch.randn(n_rows, k, dtype=w.dtype, device=w.device)
            timings = {c: time_ms(c, functools.partial(run, c, x, w)) for c in (CUBLAS, *CANDIDATES)}
            table[(n_rows, n, k)] = pick(timings)
    return table


def cuda_event_ms(candidate: Gemv | None, fn: Callable[[], object], repeats: int = 25, warmup: int = 3) -> float:
    """measure's timer: event_ms of fn (the candidate is in fn already)."""
    return event_ms(fn, repeats, warmup)


def event_ms(fn: Callable[[], object], repeats: int, warmup: int = 5) -> float:
    """Median ms of fn on the current CUDA stream, by events around each call (the first calls compile)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, table: Table | None
                 ) -> torch.Tensor:
    """F.linear(x, weight, bias), through the GEMV where the table chose it for x's rows and the shape."""
    if table and bias is None:
        choice = table.get((x.shape[0], weight.shape[0], weight.shape[1]))
        if choice is not None:
            return gemv_splitk_triton(x, weight, block_n=choice.block_n, split=choice.split)
    return F.linear(x, weight, bias)

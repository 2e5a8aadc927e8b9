"""Captured decode graphs per (slot, bucket): warmup, lazy capture, eager fallback above the top.

This file is device-agnostic bookkeeping; what a capture is comes from the `capture` callable
(slipstream/runtime/cuda_graphs.py on CUDA, a fake in the CPU tests). Invariants enforced here:
  - a (slot, bucket) is captured at most once, at warmup or on first use (with a log line);
  - a batch is padded to the smallest bucket holding it; padding is never visible to callers
    (the runner samples only the real rows);
  - a batch above the largest bucket runs eagerly, and that is logged once, not per step.
Each slot needs its own graphs: a graph reads the slot's static input buffers and writes logits
that must survive while the other slot's step runs.
"""
from __future__ import annotations

import time
from typing import Callable, Generic, TypeVar

import structlog

from slipstream.runtime.buckets import pick_bucket

log = structlog.get_logger(__name__)

G = TypeVar("G")
GiB = 1024**3


class GraphCache(Generic[G]):
    def __init__(self, buckets: list[int], num_slots: int, capture: Callable[[int, int], G],
                 free_memory: Callable[[], int] = lambda: 0):
        self.buckets = list(buckets)
        self.num_slots = num_slots
        self._capture = capture
        self._free_memory = free_memory
        self.graphs: dict[tuple[int, int], G] = {}
        self.oversize_warned = False
        self.eager_steps = 0  # decode steps too large for any bucket

    def warmup(self) -> float:
        """Capture every (slot, bucket), largest first so the shared pool is sized once. Returns seconds."""
        t0 = time.perf_counter()
        todo = [(slot, b) for b in sorted(self.buckets, reverse=True) for slot in range(self.num_slots)]
        for i, (slot, bucket) in enumerate(todo, 1):
            self._get_or_capture(slot, bucket)
            log.info("cuda_graph_warmup", graph=i, graphs=len(todo), batch_size=bucket, slot=slot,
                     free_mem_gib=round(self._free_memory() / GiB, 2))
        seconds = time.perf_counter() - t0
        log.info("cuda_graphs_captured", graphs=len(todo), buckets=len(self.buckets), slots=self.num_slots,
                 seconds=round(seconds, 2))
        return seconds

    def lookup(self, slot: int, num_rows: int) -> tuple[int, G] | None:
        """(bucket, graph) for a decode batch of `num_rows`, capturing on first use; None: run eagerly."""
        bucket = pick_bucket(self.buckets, num_rows)
        if bucket is None:
            self.eager_steps += 1
            if not self.oversize_warned:
                self.oversize_warned = True
                log.warning("decode_batch_above_graph_buckets", batch_size=num_rows, largest_bucket=self.buckets[-1],
                            effect="such steps run eagerly (logged once)")
            return None
        if (slot, bucket) not in self.graphs:
            log.info("cuda_graph_captured_on_first_use", batch_size=bucket, slot=slot)  # warmup was skipped
        return bucket, self._get_or_capture(slot, bucket)

    def _get_or_capture(self, slot: int, bucket: int) -> G:
        graph = self.graphs.get((slot, bucket))
        if graph is None:
            graph = self.graphs[(slot, bucket)] = self._capture(slot, bucket)
        return graph

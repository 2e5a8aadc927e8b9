"""Captured graphs per (slot, bucket): warmup, lazy capture, eager fallback above the top.

Five kinds share this bookkeeping: decode graphs, greedy decode graphs (which also sample), carry
decode graphs (which also feed head values and return hidden states: runtime/step/carry.py) and
speculating graphs (draft, forward, verify and advance: speculation/runner.py),
bucketed by batch size, and mixed/prefill graphs, bucketed by token count (slipstream/runtime/graphs/buckets.py). It is device-agnostic; what a capture is
comes from the `capture` callable (slipstream/runtime/graphs/cuda_graphs.py on CUDA, a fake in the CPU
tests). Invariants enforced here:
  - a (slot, bucket) is captured at most once, at warmup or on first use (with a log line and
    its duration);
  - a step is padded to the smallest bucket holding it; padding is never visible to callers
    (the runner samples only the real rows);
  - a step above the largest bucket runs eagerly, and that is logged once, not per step;
  - a capture that raises (at warmup or on first use) turns this cache off: its graphs are dropped,
    every later step of its kind runs eagerly, and one error line says why (its `error` field, and
    the traceback with the error text that any log handler prints under the line: exc_info). The
    other caches go on; the capture itself left the device as it was (runtime/graphs/graph_record.py).
Each slot needs its own graphs: a graph reads the slot's static input buffers and writes logits
that must survive while the other slot's step runs.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

import structlog

from slipstream.runtime.graphs.buckets import pick_bucket

log = structlog.get_logger(__name__)

G = TypeVar("G")
GiB = 1024**3


@dataclass(frozen=True)
class GraphKind:
    name: str  # "decode" | "greedy" | "carry" | "mixed" | "spec" | "spec_sampled" (the `kind` field of log lines)
    size_field: str  # what a bucket counts, as logged: "batch_size" | "tokens"


DECODE = GraphKind("decode", "batch_size")
GREEDY = GraphKind("greedy", "batch_size")  # decode + greedy sampling (looked up only below DECODE's top)
CARRY = GraphKind("carry", "batch_size")  # decode of carry steps (StepForward.carry)
MIXED = GraphKind("mixed", "tokens")
SPEC = GraphKind("spec", "batch_size")  # speculating steps of plain greedy rows (SpecRunner.verify_fixed)
# speculating steps of other rows: the proposal and forward (SpecRunner.forward_fixed), verified eagerly
SPEC_SAMPLED = GraphKind("spec_sampled", "batch_size")


class GraphCache(Generic[G]):
    def __init__(self, buckets: list[int], num_slots: int, capture: Callable[[int, int], G],
                 free_memory: Callable[[], int] = lambda: 0, kind: GraphKind = DECODE):
        self.buckets = list(buckets)
        self.num_slots = num_slots
        self.kind = kind
        self._capture = capture
        self._free_memory = free_memory
        self.graphs: dict[tuple[int, int], G] = {}
        self.oversize_warned = False
        self.eager_steps = 0  # steps too large for any bucket
        self.replays: Counter[tuple[int, int]] = Counter()  # steps the runner replayed, by (slot, bucket)
        self.failed: str | None = None  # why a capture failed: the cache is off (None: it is on)

    def warmup(self) -> float:
        """Capture every (slot, bucket), largest first so the shared pool is sized once. Returns seconds."""
        t0 = time.perf_counter()
        todo = [(slot, b) for b in sorted(self.buckets, reverse=True) for slot in range(self.num_slots)]
        for i, (slot, bucket) in enumerate(todo, 1):
            if self._get_or_capture(slot, bucket) is None:
                return time.perf_counter() - t0
            log.info("cuda_graph_warmup", kind=self.kind.name, graph=i, graphs=len(todo), slot=slot,
                     free_mem_gib=round(self._free_memory() / GiB, 2), **{self.kind.size_field: bucket})
        seconds = time.perf_counter() - t0
        log.info("cuda_graphs_captured", kind=self.kind.name, graphs=len(todo), buckets=len(self.buckets),
                 slots=self.num_slots, seconds=round(seconds, 2))
        return seconds

    def lookup(self, slot: int, size: int) -> tuple[int, G] | None:
        """(bucket, graph) for a step of `size` (rows or tokens), capturing on first use; None: run eagerly."""
        if self.failed is not None:
            return None
        bucket = pick_bucket(self.buckets, size)
        if bucket is None:
            self.eager_steps += 1
            if not self.oversize_warned:
                self.oversize_warned = True
                fields = dict(kind=self.kind.name, largest_bucket=self.buckets[-1],
                              effect="such steps run eagerly (logged once)", **{self.kind.size_field: size})
                if self.kind.size_field == "tokens":  # (event names are literals: docs/logging.md lists them)
                    log.warning("mixed_step_above_graph_buckets", **fields)
                else:
                    log.warning("decode_batch_above_graph_buckets", **fields)
            return None
        if (slot, bucket) not in self.graphs:  # warmup was skipped
            t0 = time.perf_counter()
            graph = self._get_or_capture(slot, bucket)
            if graph is None:
                return None
            log.info("cuda_graph_captured_on_first_use", kind=self.kind.name, slot=slot,
                     seconds=round(time.perf_counter() - t0, 3), **{self.kind.size_field: bucket})
            return bucket, graph
        return bucket, self.graphs[(slot, bucket)]

    def release(self) -> None:
        """Drop the captured graphs (the engine closes; the device has synchronized)."""
        self.graphs.clear()

    def _get_or_capture(self, slot: int, bucket: int) -> G | None:
        """The graph of (slot, bucket), captured if needed; None: a capture failed, the cache is off."""
        graph = self.graphs.get((slot, bucket))
        if graph is None:
            try:
                graph = self.graphs[(slot, bucket)] = self._capture(slot, bucket)
            except Exception as e:  # noqa: BLE001 - eager steps still work: logged once, readable
                self.failed = f"{type(e).__name__}: {e}"
                self.graphs.clear()
                log.error("cuda_graph_capture_failed", kind=self.kind.name, slot=slot, error=self.failed,
                          effect=f"{self.kind.name} steps run eagerly", exc_info=True,
                          **{self.kind.size_field: bucket})
                return None
        return graph

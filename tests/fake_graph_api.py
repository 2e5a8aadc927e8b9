"""A stand-in for the torch.cuda calls of slipstream/runtime/graphs/graph_record.py, keeping the caching
allocator's capture bookkeeping the way torch 2.11 does (aten/src/ATen/cuda/CUDAGraph.cpp,
c10/cuda/CUDACachingAllocator.cpp), so CPU tests can show that a failed capture poisons nothing:
  * capture_begin takes a pool reference and records the pool as "being allocated to"; a second
    capture into a pool still recorded to raises "beginAllocateToPool: already recording to mempool_id";
  * capture_end ends the stream's capture first and raises there when the capture was invalidated
    (an API call a capture forbids: `forbidden_call`), leaving the pool recorded to;
  * a graph whose capture ended holds its pool reference until it is destroyed; destroying it
    mid-capture (its finalizer run by a cycle collection on the capturing thread) is a forbidden
    call: it invalidates that capture.
A replay re-runs what was captured and copies the result into the captured output's storage (the
fixed addresses a real graph writes).
"""
from __future__ import annotations

import contextlib
from collections import Counter


class FakeGraph:
    def __init__(self, api: "FakeGraphApi"):
        self.api, self.pool, self.fn, self.output = api, None, None, None
        self.ended = False
        self.invalidated = False

    def replay(self) -> None:
        assert self.ended, "replay of a graph whose capture did not end"
        new = self.fn()
        pairs = zip(self.output, new) if isinstance(new, tuple) else [(self.output, new)]
        for old, fresh in pairs:
            old.copy_(fresh)

    def __del__(self):
        if self.ended:
            self.api.forbidden_call()  # cudaGraphExecDestroy
            self.api.refs[self.pool] -= 1


class FakeGraphApi:
    def __init__(self):
        self.recording: list = []  # pools being allocated to (torch: captures_underway)
        self.refs: Counter = Counter()  # pool -> references (captures begun and not released)
        self.capture: FakeGraph | None = None  # the capture the stream is in
        self.streams: list = ["default"]  # the current stream, innermost last
        self.calls: list[str] = []

    def prepare(self) -> None:
        pass

    def new_graph(self) -> FakeGraph:
        return FakeGraph(self)

    def run(self, graph: FakeGraph, fn):
        graph.fn = fn
        graph.output = fn()
        return graph.output

    @contextlib.contextmanager
    def stream(self, stream):
        self.streams.append(stream)
        try:
            yield
        finally:
            self.streams.pop()

    def begin(self, graph: FakeGraph, pool) -> None:
        self.calls.append("begin")
        if pool in self.recording:
            raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
        assert self.capture is None, "one capture at a time"
        self.recording.append(pool)
        self.refs[pool] += 1
        graph.pool, self.capture = pool, graph

    def forbidden_call(self) -> None:
        """What cudaGraphExecDestroy (or cudaMalloc ...) does on the capturing thread mid-capture."""
        if self.capture is not None:
            self.capture.invalidated = True

    def end(self, graph: FakeGraph) -> None:
        self.calls.append("end")
        assert self.capture is graph, "capture_end without a capture"
        self.capture = None  # cudaStreamEndCapture ends it, valid or not
        if graph.invalidated:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.recording.remove(graph.pool)
        graph.ended = True

    def end_pool(self, device, pool) -> None:
        self.calls.append("end_pool")
        if pool not in self.recording:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.recording.remove(pool)

    def release_pool(self, device, pool) -> None:
        self.calls.append("release_pool")
        self.refs[pool] -= 1
        assert self.refs[pool] >= 0, "pool released more often than taken"

    @property
    def clean(self) -> bool:
        """No capture on, no pool recorded to, stream back to the default."""
        return self.capture is None and not self.recording and self.streams == ["default"]

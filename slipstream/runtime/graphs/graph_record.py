"""Recording one CUDA graph so that a failed capture leaves the process as it was.

Seen on an H100 (docs/results/h100-2026-11-27/README.md): a capture invalidated mid-way left the
caching allocator "recording to" the graphs' shared pool, so every later capture into that pool
raised `beginAllocateToPool: already recording to mempool_id` and the engine could not start. Two
things in torch make a failure sticky, and `record` undoes both:
  * `CUDAGraph.capture_end` checks `cudaStreamEndCapture` BEFORE it tells the allocator the
    capture is over; an invalidated capture raises there and the pool stays recorded to (and
    `torch.cuda.graph.__exit__` then skips restoring the current stream). So a failure ends the
    stream's capture if it is still on, ends the pool's recording, gives back the pool reference
    the capture took, and the `with` restores the stream.
  * what invalidated it: garbage of an earlier engine (its CUDAGraphs sit in reference cycles)
    collected mid-capture on the capturing thread, whose finalizer calls cudaGraphExecDestroy,
    an API call a capture forbids ("operation not permitted when stream is capturing (function
    reset)"). So the cycle collector is off while a capture runs (engines also release their
    graphs at close: slipstream/api/assemble.py), and the capture mode is "thread_local": another
    thread (another engine in the process serving meanwhile) may make such calls without failing
    them or this capture ("global" would do both).
The torch calls go through `GraphApi`, so CPU tests run this file against a fake that keeps the
allocator's bookkeeping the way torch does (tests/fake_graph_api.py).
"""
from __future__ import annotations

import gc
from typing import Any, Callable

import torch


class GraphApi:
    """The torch.cuda calls a capture makes."""

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def prepare(self) -> None:
        """What torch.cuda.graph does before a capture: the cached blocks go back, so the pool is
        measured alone (tests/test_memory_budget.py) and the capture has the most memory."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def stream(self, stream) -> Any:
        return torch.cuda.stream(stream)

    def run(self, graph, fn: Callable[[], Any]) -> Any:
        """What the capture records (a fake keeps `fn` to replay it)."""
        return fn()

    def begin(self, graph, pool) -> None:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")

    def end(self, graph) -> None:
        graph.capture_end()

    def end_pool(self, device: torch.device, pool) -> None:
        torch._C._cuda_endAllocateToPool(device.index or 0, pool)

    def release_pool(self, device: torch.device, pool) -> None:
        torch._C._cuda_releasePool(device.index or 0, pool)


API = GraphApi()


def record(run: Callable[[], Any], pool, stream, device: torch.device, api: GraphApi | None = None) -> tuple[Any, Any]:
    """(graph, what run() returned): run() captured on `stream` into `pool`. Raises what failed,
    after putting the stream, the allocator and the pool back as they were before the capture."""
    api = API if api is None else api
    api.prepare()
    graph = api.new_graph()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with api.stream(stream):
            api.begin(graph, pool)
            ended = False
            try:
                out = api.run(graph, run)
                ended = True  # (capture_end reached: the stream's capture is over, raise or not)
                api.end(graph)
            except BaseException:
                _abandon(api, graph, pool, device, ended)
                raise
    finally:
        if collecting:
            gc.enable()
    return graph, out


def _abandon(api: GraphApi, graph, pool, device: torch.device, ended: bool) -> None:
    if not ended:  # run() raised: the stream is still capturing (valid or invalidated)
        try:
            api.end(graph)  # a valid capture ends cleanly: the graph then holds the pool reference,
            return          # given back when it is dropped
        except Exception:  # noqa: BLE001 - invalidated: it raised before ending the pool's recording
            pass
    try:
        api.end_pool(device, pool)
    except Exception:  # noqa: BLE001 - capture_end got past it: the graph owns the reference
        return
    api.release_pool(device, pool)  # the reference capture_begin took (the graph never will)

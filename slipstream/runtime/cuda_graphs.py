"""Capturing a slot's decode forward as a CUDA graph for one batch-size bucket.

What is captured: the gather of the decode rows' tokens, positions and page rows from the row
tables → embedding → layers (Triton paged attention) → final norm → lm_head → positions advanced,
reading the slot's StepArena device views for that bucket and writing a logits tensor owned by the
graph. Replay therefore needs only: fill + upload the arena (the upload stream, pinned), the
step's row-table writes, then `replay()` on the compute stream; addresses never change. Sampling
stays eager (see model_runner.py). All graphs share one memory pool: they run one at a time on the
compute stream, so their intermediates can overlap; each graph's logits stay alive (held here),
so no later capture reuses them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.runtime.batch import pack_step
from slipstream.runtime.buckets import make_buckets
from slipstream.runtime.graphs import GraphCache


@dataclass
class CapturedDecode:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [bucket, vocab], rewritten by every replay

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


def decode_graphs(runner, device, bucket_range: tuple[int, int, int]) -> GraphCache[CapturedDecode]:
    """A GraphCache whose captures record `runner.forward_from` on the compute stream."""
    pool = torch.cuda.graph_pool_handle()
    stream = device.compute.stream

    def capture(slot: int, bucket: int) -> CapturedDecode:
        arena = runner.arenas[slot]
        layout = arena.fill(pack_step(np.zeros(0, np.int64), []), pad_decode=bucket)  # all padding rows
        arena.upload()
        tensors = arena.tensors(layout)
        with torch.cuda.stream(stream):
            runner.forward_from(tensors)  # compiles kernels, creates handles: nothing of that in the graph
        torch.cuda.synchronize(device.torch_device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            logits = runner.forward_from(tensors)
        torch.cuda.synchronize(device.torch_device)
        return CapturedDecode(graph, logits)

    return GraphCache(make_buckets(*bucket_range), len(runner.slots), capture, device.free_memory)

"""Capturing a slot's forward as CUDA graphs: decode steps per batch-size bucket, mixed/prefill
steps per token bucket.

Decode graph: the gather of the decode rows' tokens, positions and page rows from the row tables →
embedding → layers (Triton paged attention) → final norm → lm_head → positions advanced, reading
the slot's StepArena device views for that bucket and writing a logits tensor owned by the graph.
Mixed graph: the same forward on the fixed-shape layout of its token bucket
(slipstream/runtime/graphs/static_step.py): decode tokens gathered from the row tables, chunk tokens from
the arena, padding tokens on the scratch page, attention over a device block table; logits of
min(T, S) rows, of which the step samples its own.

Greedy decode graph: the decode graph plus the sampling of a step whose rows are all plain greedy
(StepForward.greedy: argmax, last-token table, output indices, the slot's sampled ids), chosen
per step from the rows' flag mirrors when no grammar mask is live; its launch_sampling only stamps
the step. Every other step samples eagerly after the replay (see model_runner.py).

Carry decode graph: the decode graph of a carry step (StepForward.carry, runtime/step/carry.py):
each row's kind and values read from the row tables on the device, the head encodings swapped in
with torch.where, and (logits, hidden) as its outputs, which the step's eager sampling reads. A
separate set, so steps without carry rows keep replaying the plain decode graphs unchanged; warmed
up only for a model with carry heads (otherwise captured on first use, which never comes).

Replay therefore needs only: fill + upload the arena (the upload stream, pinned), the step's
row-table writes, then `replay()` on the compute stream; addresses never change. All graphs share
one memory pool: they run one at a time on the compute stream, so their intermediates can overlap.
Each graph's output stays alive (held here), so no later capture reuses it, but a later graph's
output may sit where an earlier graph keeps intermediates: a replay can overwrite another graph's
logits. That is safe because every step's sampling is enqueued (the tick finalizes the step it
launched) before the next step is launched, so stream order consumes the logits first; the runner
checks it before each replay (`step_slot.check_others_sampled`). Two steps in the same
slot never overlap (a slot is reacquired only after its step's commit), so a graph's reuse by the
slot's next step is safe too; the whole argument: docs/cuda.md, "Which step reads which outputs".
Mixed graphs are captured
first at warmup: the largest token bucket needs the largest intermediates, and the pool is then
sized once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import structlog
import torch

from slipstream.runtime.batch import pack_step
from slipstream.runtime.graphs.buckets import make_buckets, token_buckets
from slipstream.runtime.graphs.graph_record import record
from slipstream.runtime.graphs.cache import CARRY, DECODE, GREEDY, MIXED, SPEC, SPEC_SAMPLED, GraphCache
from slipstream.runtime.graphs.static_step import fill_static, static_tensors

log = structlog.get_logger(__name__)
GiB = 1024**3


@dataclass
class CapturedForward:
    graph: torch.cuda.CUDAGraph
    # logits [bucket rows, vocab] (greedy graphs: the sampled ids; carry graphs: (logits, hidden)),
    # rewritten by every replay
    output: torch.Tensor | tuple[torch.Tensor, torch.Tensor]

    def replay(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        self.graph.replay()
        return self.output


def _capture(runner, device, pool, stage: Callable[[], object], forward=None) -> CapturedForward:
    """Stage an all-padding step (rows 0, the scratch page), run it once eagerly (kernels compile,
    handles are created: nothing of that belongs in the graph), then capture the same forward.
    `forward(tensors)` is what is captured (default: runner.forward.logits)."""
    forward = runner.forward.logits if forward is None else forward
    stream = device.compute.stream
    tensors = stage()
    with torch.cuda.stream(stream):
        forward(tensors)
    torch.cuda.synchronize(device.torch_device)
    # (a failure leaves stream, allocator and pool as they were: graph_record.py)
    graph, output = record(lambda: forward(tensors), pool, stream, device.torch_device)
    torch.cuda.synchronize(device.torch_device)
    return CapturedForward(graph, output)


def _empty_step():
    return pack_step(np.zeros(0, np.int64), [])


def decode_graphs(runner, device, bucket_range: tuple[int, int, int], pool=None,
                  greedy: bool = False, carry: bool = False) -> GraphCache[CapturedForward]:
    """A GraphCache of decode steps whose captures record `runner.forward.logits` on the compute stream
    (`greedy`: runner.forward.greedy, which also samples every row greedily; `carry`:
    runner.forward.carry, the decode step of a carry step)."""
    assert not (greedy and carry)
    pool = torch.cuda.graph_pool_handle() if pool is None else pool

    def capture(slot: int, bucket: int) -> CapturedForward:
        arena = runner.slots[slot].arena

        def stage():
            layout = arena.fill(_empty_step(), pad_decode=bucket)  # all padding rows
            arena.upload()
            return arena.tensors(layout)

        forward = (lambda tensors: runner.forward.greedy(tensors, runner.slots[slot])) if greedy \
            else runner.forward.carry if carry else None
        return _capture(runner, device, pool, stage, forward)

    return GraphCache(make_buckets(*bucket_range), len(runner.slots), capture, device.free_memory,
                      GREEDY if greedy else CARRY if carry else DECODE)


def mixed_graphs(runner, device, token_range: tuple[int, int], pool=None) -> GraphCache[CapturedForward]:
    """A GraphCache of mixed/prefill steps by token bucket (static_step.py's fixed-shape layout)."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool

    def capture(slot: int, tokens: int) -> CapturedForward:
        arena = runner.slots[slot].arena

        def stage():
            arena.fill(_empty_step())
            fill_static(arena, _empty_step(), tokens)  # padding tokens and q_len-0 sequences only
            arena.upload()
            return static_tensors(arena, tokens)

        return _capture(runner, device, pool, stage)

    return GraphCache(token_buckets(*token_range), len(runner.slots), capture, device.free_memory, MIXED)


def spec_graphs(runner, device, bucket_range: tuple[int, int, int], pool=None,
                sampled: bool = False) -> GraphCache[CapturedForward]:
    """A GraphCache of speculating steps by rows bucket: SpecRunner.verify_fixed on the fixed-k layout
    (speculation/runner.py), staged as an all-padding step (row 0, no drafts); `sampled`: only its
    proposal and forward (SpecRunner.forward_fixed, output (logits, drafts)), for steps whose rows do
    not all verify greedily: their verification runs eagerly after the replay, as the eager step's."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    spec = runner.spec

    def capture(slot: int, bucket: int) -> CapturedForward:
        arena = runner.slots[slot].arena

        def stage():
            arena.fill(_empty_step(), pad_decode=bucket)
            arena.upload()
            spec.staging[slot].stage_fixed(np.zeros(0, np.int64), bucket)
            return spec.fixed_layout(slot, bucket)

        captured = (lambda t: spec.forward_fixed(t, slot)) if sampled else (lambda t: spec.verify_fixed(t, slot))
        return _capture(runner, device, pool, stage, captured)

    return GraphCache(make_buckets(*bucket_range), len(runner.slots), capture, device.free_memory,
                      SPEC_SAMPLED if sampled else SPEC)


def install_graphs(runner, device, config) -> None:
    """Give `runner` its decode, greedy decode, carry decode (and, with config.mixed_graphs, mixed) graph
    caches sharing one pool; with config.warmup capture them all now (mixed first; carry graphs only
    for a model with carry heads), logging the time and memory taken."""
    pool = torch.cuda.graph_pool_handle()
    runner.graphs = decode_graphs(runner, device, config.buckets(), pool)
    runner.greedy_graphs = decode_graphs(runner, device, config.buckets(), pool, greedy=True)
    runner.carry_graphs = decode_graphs(runner, device, config.buckets(), pool, carry=True)
    if config.mixed_graphs:
        runner.mixed_graphs = mixed_graphs(runner, device, config.token_bucket_range(), pool)
    if runner.spec is not None and runner.spec.graphable:  # (installed first: assemble.py)
        runner.spec_graphs = spec_graphs(runner, device, config.buckets(), pool)
        runner.spec_sampled_graphs = spec_graphs(runner, device, config.buckets(), pool, sampled=True)
    if not config.warmup:
        return
    carry = runner.carry_graphs if runner.carry_kinds else None  # (no heads: no carry step ever comes)
    for cache in (runner.mixed_graphs, runner.spec_graphs, runner.spec_sampled_graphs, runner.graphs,
                  runner.greedy_graphs, carry):
        if cache is not None:
            before = torch.cuda.memory_reserved(device.torch_device)
            seconds = cache.warmup()  # (a failed capture turns only this cache off: graphs.py)
            log.info("cuda_graphs_memory", kind=cache.kind.name, seconds=round(seconds, 2),
                     reserved_gib=round((torch.cuda.memory_reserved(device.torch_device) - before) / GiB, 3))


def release_graphs(runner) -> None:
    """Drop every captured graph now (engine close, the device synchronized): freed here, not by a
    later cycle collection that could run inside another engine's capture (graph_record.py)."""
    for cache in (runner.graphs, runner.greedy_graphs, runner.carry_graphs, runner.mixed_graphs, runner.spec_graphs,
                  runner.spec_sampled_graphs):
        if cache is not None:
            cache.release()
    for slot in runner.slots:  # a staged input holds the graph it chose (a steady batch relaunches it)
        slot.staged = None
        slot.owner = None

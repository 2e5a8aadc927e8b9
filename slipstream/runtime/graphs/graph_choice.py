"""Which path a step runs on: a captured graph of its slot (decode, greedy decode, carry decode,
mixed) or eagerly. `GraphChoice` is a base of ModelRunner (model_runner.py), which asks it once per
input a slot stages (`_choose_graph`): a steady batch's relaunches keep the choice with the input.

The graph caches are fields of the runner (None: no graphs of that kind; set by
cuda_graphs.install_graphs; a kind whose capture failed answers None to every lookup: graphs.py). Installing or dropping one
forgets what the slots staged, since their choice was made without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slipstream.models.base import Model, reads_device_attention
from slipstream.runtime.batch import ForwardInput
from slipstream.runtime.graphs.cache import GraphCache
from slipstream.runtime.sampling.sampling_args import GroupNeeds
from slipstream.runtime.step.step_slot import StepSlot

@dataclass(frozen=True)
class _Graphed:
    """How a step replays a captured graph (no _Graphed: it runs eagerly)."""

    cache: GraphCache
    bucket: int  # rows (decode) or tokens (mixed) the graph was captured for
    graph: Any  # what the cache's capture returned: .replay() -> logits (or ids when `samples`)
    mixed: bool  # a mixed graph: reads the static layout (static_step.py), not a padded decode layout
    samples: bool  # a greedy decode graph: it samples every row too (launch_sampling only stamps)
    carry: bool = False  # a carry decode graph: replay() -> (logits, hidden) (StepForward.carry)


class _GraphCacheField:
    """A graph cache of the runner (None: none). Installing or dropping one forgets what the slots
    staged: their graph choice was made without it."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = "_" + name

    def __get__(self, runner, owner=None) -> GraphCache | None:
        return getattr(runner, self.name, None)

    def __set__(self, runner, cache: GraphCache | None) -> None:
        setattr(runner, self.name, cache)
        for slot in runner.slots:
            slot.staged = None


class GraphChoice:
    model: Model  # (the ModelRunner's)
    row_multiple: int
    slots: list[StepSlot]

    graphs = _GraphCacheField()  # CUDA graphs of decode steps (slipstream/runtime/graphs/cuda_graphs.py)
    mixed_graphs = _GraphCacheField()  # ... of mixed/prefill steps, by token bucket
    greedy_graphs = _GraphCacheField()  # decode graphs that also sample (all rows plain greedy)
    carry_graphs = _GraphCacheField()  # decode graphs of carry steps (StepForward.carry)
    spec_graphs = _GraphCacheField()  # speculating steps by rows, fixed k (SpecRunner.verify_fixed)
    spec_sampled_graphs = _GraphCacheField()  # ... their proposal and forward only (SpecRunner.forward_fixed)

    def _choose_graph(self, slot: StepSlot, packed: ForwardInput, unmasked: bool, carry: bool,
                      needs: GroupNeeds) -> _Graphed | None:
        """The graph this step replays, capturing it on first use; None: the step runs eagerly.
        A carry step replays only a carry decode graph (decode-only); with chunks it runs eagerly."""
        if carry:
            cache = self.carry_graphs
            hit = cache.lookup(slot.index, packed.num_decode) if cache is not None and self._graphable(packed) else None
            return None if cache is None or hit is None else _Graphed(cache, hit[0], hit[1], mixed=False,
                                                                       samples=False, carry=True)
        if self._graphable(packed):
            assert self.graphs is not None
            hit = self.graphs.lookup(slot.index, packed.num_decode)
            if hit is None:
                return None
            if unmasked and self.greedy_graphs is not None and needs.plain_greedy:
                greedy = self.greedy_graphs.lookup(slot.index, packed.num_decode)
                if greedy is not None:  # (the same buckets as self.graphs; None: its capture failed)
                    return _Graphed(self.greedy_graphs, greedy[0], greedy[1], mixed=False, samples=True)
            return _Graphed(self.graphs, hit[0], hit[1], mixed=False, samples=False)
        if self._mixed_graphable(packed):
            assert self.mixed_graphs is not None
            hit = self.mixed_graphs.lookup(slot.index, packed.num_tokens)
            if hit is not None:
                return _Graphed(self.mixed_graphs, hit[0], hit[1], mixed=True, samples=False)
        return None

    def _graphable(self, packed: ForwardInput) -> bool:
        """Decode-only steps (one device-fed, sampled token per row; no CPU row padding)."""
        return self.graphs is not None and self.row_multiple == 1 and packed.num_decode > 0 and packed.decode_only

    def _mixed_graphable(self, packed: ForwardInput) -> bool:
        """Steps with prefill chunks, when the model reads device attention metadata (a graph cannot
        hold the host-side reference attention) and no CPU row padding is asked for."""
        return (self.mixed_graphs is not None and self.row_multiple == 1 and not packed.decode_only
                and reads_device_attention(self.model) and not packed.has_embeds  # image rows: eager
                and packed.bidirectional_lens is None)  # (the graph's attention is plain causal)

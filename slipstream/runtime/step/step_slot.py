"""A step in flight on the runner: the buffers it owns (`StepSlot`) and the record of its launch
(`LaunchedStep`). The brief calls the slot a DecodeSlot.

`StepSlot` is buffers, allocated once and reused (ping-pong), and the staging of an input into them
(`stage`): the step's staged inputs (its `StepArena`, and `staged`: which ForwardInput the arena
holds and how it runs), the sampled ids with
their stamp, logprobs, top_logprobs, carried values, sampling groups' row indices and masks, each
on the device and as a host landing buffer. Everything that belongs to one step is on its
`LaunchedStep`, which `ModelRunner.launch_forward` returns and the engine loop hands back to
launch its late sampling, await its tokens and read them.

Lifecycle, enforced here: a slot is free or owned by one launched step (`owner`), from `acquire` (launch) to
`release` (after the commit has read the host landing buffer). A slot is not free when the device
is done with it, only when the host has consumed its copy: its host buffer is the landing site of
a copy that may still be in flight. Acquiring a slot that is not free raises SlotReuseError.

After a commit reads the landing buffer, the slot poisons it, so a reader that runs before the
next copy has landed sees POISON instead of stale tokens that look plausible. The step's last
sampling also writes its step id into `stamp`, which travels in the same copy: a commit whose
stamp is not its own step id would read tokens that sampling never wrote for it (stale device
buffers), and raises instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from slipstream.errors import PipelineInvariantError, SlotReuseError
from slipstream.grammar.bitmask import words_for
from slipstream.runtime.batch import MAX_CARRY_VALUES, MAX_TOP_LOGPROBS, ForwardInput
from slipstream.runtime.devices.host_copy import copy_to_host
from slipstream.runtime.graphs.static_step import fill_static
from slipstream.runtime.step.carry import stage_chunk_carry

if TYPE_CHECKING:
    from slipstream.runtime.step.carry import ChunkCarry
    from slipstream.runtime.devices.device import Event, Mark
    from slipstream.runtime.sampling.sampling_args import GroupNeeds
    from slipstream.runtime.step.staging import RowUpdates, StepArena, StepTensors

POISON = -7
MAX_GROUPS = 2


@dataclass(frozen=True, eq=False)
class Staged:
    """A ForwardInput staged in a slot's arena, and how it runs there. A steady batch relaunches the
    same ForwardInput (the scheduler's persistent batch): then this is reused as it is, with no
    staging, no graph choice and no upload (ModelRunner.launch_forward)."""

    packed: ForwardInput
    unmasked: bool  # no sampling group of it carries a grammar mask (launch_forward's argument)
    graphed: Any  # ModelRunner's graph choice (_Graphed), None: it runs eagerly
    tensors: StepTensors  # device views of its inputs in the slot's arena
    updates: RowUpdates | None  # row-table writes before its forward; None: none
    carry: bool  # a carry step (runtime/step/carry.py)
    chunk_carry: ChunkCarry | None  # its chunks' carried inputs (eager carry steps)
    needs: GroupNeeds  # what sampling all its rows needs (from the host mirrors, at staging)
    sampled_in_graph: bool = field(init=False)  # its greedy decode graph samples every row (launch_sampling stamps)
    num_samples: int = field(init=False)  # (its input's sampling rows, read at every launch and commit)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sampled_in_graph", self.graphed is not None and self.graphed.samples)
        object.__setattr__(self, "num_samples", self.packed.num_samples)


class StepSlot:
    def __init__(self, index: int, device, max_samples: int, vocab_size: int, arena: StepArena):
        self.index = index
        self.arena = arena
        self.staged: Staged | None = None  # what the arena holds now (stage, restage_writes; None: forget it)
        self.owner: LaunchedStep | None = None  # the step in flight in this slot
        # [stamp, sampled ids]: one buffer, so one copy of its first n + 1 entries carries both
        self.stamp_and_sampled = torch.zeros(max_samples + 1, dtype=torch.int64, device=device.torch_device)
        self.stamp, self.sampled = self.stamp_and_sampled[:1], self.stamp_and_sampled[1:]
        self.stamp.fill_(-1)
        self.host_stamp_and_sampled = device.host_buffer((max_samples + 1,), torch.int64)
        self._host = self.host_stamp_and_sampled.numpy()
        self._host[:] = POISON
        self.logprobs = torch.zeros(max_samples, dtype=torch.float32, device=device.torch_device)
        self.host_logprobs = device.host_buffer((max_samples,), torch.float32)
        # top_logprobs alternatives (SamplingParams.top_logprobs): copied only for steps that want them
        self.top_values = torch.zeros(max_samples, MAX_TOP_LOGPROBS, dtype=torch.float32, device=device.torch_device)
        self.top_ids = torch.zeros(max_samples, MAX_TOP_LOGPROBS, dtype=torch.int64, device=device.torch_device)
        self.host_top_values = device.host_buffer((max_samples, MAX_TOP_LOGPROBS), torch.float32)
        self.host_top_ids = device.host_buffer((max_samples, MAX_TOP_LOGPROBS), torch.int64)
        # a carry step's (kind, values...) per sampling row (runtime/step/carry.py), copied with its tokens
        self.carry_out = torch.zeros(max_samples, 1 + MAX_CARRY_VALUES, dtype=torch.float32,
                                     device=device.torch_device)
        self.host_carry = device.host_buffer((max_samples, 1 + MAX_CARRY_VALUES), torch.float32)
        # Sampling groups (all rows at once, or unconstrained rows at launch and constrained rows at
        # finalize): each stages its sampling-row indices and packed allowed-token masks in host
        # buffers of its own, uploaded in one go (pinned on CUDA; shared memory on the CPU). The
        # rows' sampling parameters live in the runner's row tables, not here.
        words = words_for(vocab_size)
        self.group_host = device.host_buffer((MAX_GROUPS, max_samples), torch.int64)
        self.mask_host = device.host_buffer((MAX_GROUPS, max_samples, words), torch.int32)
        if device.unified_memory:
            self.group_dev, self.mask_dev = self.group_host, self.mask_host
        else:
            self.group_dev = torch.zeros_like(self.group_host, device=device.torch_device)
            self.mask_dev = torch.zeros(MAX_GROUPS, max_samples, words, dtype=torch.int32, device=device.torch_device)

    def acquire(self, step: LaunchedStep) -> None:
        if self.owner is not None:
            raise SlotReuseError(
                f"slot {self.index} relaunched for step {step.step_id} while step {self.owner.step_id} "
                "has not been committed (its host landing buffer may still be receiving a copy)"
            )
        self.owner = step

    def stage(self, packed: ForwardInput, unmasked: bool, sampling, choose_graph) -> Staged:
        """Stage `packed` in the arena: row mirrors, its path (`choose_graph`: a graph or None,
        eagerly; ModelRunner's GraphChoice), the upload; kept as what the slot holds."""
        if packed.chunks:
            sampling.mirror(packed.chunks)
        # a row that may carry a head value makes the step a carry step (runtime/step/carry.py)
        carry = bool(sampling.carry_rows) and (sampling.any_carry(packed.sample_rows)
                                               or any(w.carry for w in packed.chunks))
        needs = sampling.needs(packed.sample_rows)
        graphed = choose_graph(self, packed, unmasked, carry, needs)
        arena = self.arena
        lay = arena.fill(packed, pad_decode=graphed.bucket if graphed is not None and not graphed.mixed else 0)
        if graphed is not None and graphed.mixed:
            fill_static(arena, packed, graphed.bucket)
        arena.upload()
        writes = lay.w or lay.c
        self.staged = Staged(packed, unmasked, graphed, arena.tensors(lay), arena.updates(lay) if writes else None,
                             carry, stage_chunk_carry(packed) if carry and graphed is None else None, needs)
        return self.staged

    def restage_writes(self, staged: Staged, packed: ForwardInput) -> Staged:
        """`packed` shares every array but its page-table entries with the input the slot holds
        (ForwardInput.with_page_writes): only those are staged; path, views and needs stay."""
        updates = self.arena.stage_writes(packed.page_writes) if len(packed.page_writes) else None
        self.staged = replace(staged, packed=packed, updates=updates)
        return self.staged

    def stage_group(self, g: int, rows, bitmask) -> None:
        """Write sampling group `g`'s row indices (and masks) into its host buffers."""
        k = len(rows)
        self.group_host[g].numpy()[:k] = rows
        if bitmask is not None:
            self.mask_host[g, :k].numpy()[:] = bitmask

    def read_host(self, step: LaunchedStep, n: int, logprobs: bool) -> tuple[list[int], list[float] | None]:
        """The step's n sampled ids (and their logprobs, if asked); valid once its copy completed."""
        if self.owner is not step or step.copy_done is None or not step.copy_done.query():
            raise PipelineInvariantError(f"slot {self.index}: host buffer read before its copy landed")
        host = self._host
        stamp, ids = int(host[0]), host[1:n + 1].tolist()
        if POISON in ids:
            raise PipelineInvariantError(f"slot {self.index}: poisoned token read (copy did not land)")
        if n and stamp != step.step_id:
            raise PipelineInvariantError(f"slot {self.index}: step {step.step_id} read tokens stamped by step {stamp} "
                                         "(its sampling never ran: stale device buffer)")
        host[:n + 1] = POISON
        return ids, self.host_logprobs[:n].tolist() if logprobs else None

    def release(self) -> None:
        if self.owner is None:
            raise PipelineInvariantError(f"slot {self.index} released twice")
        self.owner.logits = self.owner.hidden = None
        self.owner = None

    def abandon(self) -> None:
        """Free the slot of a failed step without reading it (the device has drained)."""
        self._host[:] = POISON
        self.release()


@dataclass(eq=False)
class LaunchedStep:
    """The runner's record of one step from its launch to its commit: the one runtime type of a
    launched step. The engine loop holds it (`Step.launched`) and only hands it back."""

    step_id: int
    slot: StepSlot
    staged: Staged
    num_samples: int = 0  # its sampling rows (the staged input's)
    groups: int = 0  # sampling groups launched
    top_k: int = 0  # the largest top_logprobs of its sampled rows (0: none; copied back only then)
    logprobs: bool = False  # some sampled row returns its logprob (copied back only then)
    sampled: bool = False  # its final sampling is launched: nothing of it reads its logits after that
    logits: torch.Tensor | None = None  # written by its forward on the compute stream, read by its sampling
    hidden: torch.Tensor | None = None  # a carry step's hidden states of its sample rows
    copy_done: Event | None = None  # its tokens are on the host
    # with timed speculation, an unmasked step's span on the compute stream (forward to its copy): what the
    # policy prices a speculating step by against a plain one (SampledTokens.step_ms)
    started: Mark | None = None
    ended: Mark | None = None

    @property
    def step_ms(self) -> float | None:
        return None if self.started is None or self.ended is None else self.started.ms_to(self.ended)

    @property
    def sample_rows_host(self) -> np.ndarray:
        return self.staged.packed.sample_rows

    def next_group(self) -> int:
        g = self.groups
        if g >= MAX_GROUPS:
            raise PipelineInvariantError(f"step {self.step_id}: more than {MAX_GROUPS} sampling groups")
        self.groups += 1
        return g

    def copy_out(self) -> None:
        """Its outputs to the slot's host landing buffers (on whichever stream runs it)."""
        slot, n = self.slot, self.num_samples
        copy_to_host(slot.host_stamp_and_sampled[:n + 1], slot.stamp_and_sampled[:n + 1])
        if self.logprobs:
            copy_to_host(slot.host_logprobs[:n], slot.logprobs[:n])
        if self.staged.carry:  # only the rows' own (kind, values): never read back by a later step
            copy_to_host(slot.host_carry[:n], slot.carry_out[:n])
        if self.top_k:  # whole rows: [:n, :top] would be a strided view (host_copy.py)
            copy_to_host(slot.host_top_values[:n], slot.top_values[:n])
            copy_to_host(slot.host_top_ids[:n], slot.top_ids[:n])


def launch_copy(device, step: LaunchedStep, copy_out: Callable[[], None] | None = None) -> None:
    """The step's tokens to the host, behind its final sampling: on a device whose host memory is
    device memory (the CPU) in stream order on the compute stream (no copy engine to overlap, no
    second stream to wake and wait for), else on the copy stream after an event. `copy_out`: a
    speculating step's copy (its runs; default: LaunchedStep.copy_out)."""
    step.sampled = True
    compute = device.compute
    if step.started is not None:
        step.ended = compute.mark()
    if copy_out is None:
        copy_out = step.copy_out
    if device.unified_memory:
        compute.launch(copy_out, "d2h")
        step.copy_done = compute.record()
        return
    copy = device.copy
    copy.wait(compute.record())  # the copy waits for exactly this step's outputs
    copy.launch(copy_out, "d2h")
    step.copy_done = copy.record()


def check_others_sampled(slots: list[StepSlot], step: LaunchedStep) -> None:
    """Before a graph replay: all graphs share one memory pool, so a replay may overwrite memory that
    holds another graph's logits. Safe because a step's sampling is all enqueued (the tick finalizes
    it) before the next step is launched, so stream order runs it before this replay."""
    for other in slots:
        owner = other.owner
        if owner is not None and owner is not step and not owner.sampled:
            raise PipelineInvariantError(f"step {step.step_id} replays a graph while step {owner.step_id}'s "
                                         "sampling is not launched: the replay could overwrite its logits")

"""StepSlot: the buffers one in-flight step (decode rows, prompt chunks or both) owns, allocated
once and reused (ping-pong). The brief calls it DecodeSlot.

Lifecycle, enforced here: FREE --acquire (launch)--> IN_FLIGHT --release (after the commit has
read the host landing buffer)--> FREE. A slot is not free when the device is done with it, only
when the host has consumed its copy: its host buffer is the landing site of a copy that may still
be in flight. Acquiring a slot that is not free raises SlotReuseError.

After a commit reads the landing buffer, the slot poisons it, so a reader that runs before the
next copy has landed sees POISON instead of stale tokens that look plausible. The step's last
sampling also writes its step id into `stamp`, which travels in the same copy: a commit whose
stamp is not its own step id would read tokens that sampling never wrote for it (stale device
buffers), and raises instead.
"""
from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np
import torch

from slipstream.errors import PipelineInvariantError, SlotReuseError
from slipstream.grammar.bitmask import words_for
from slipstream.runtime.batch import MAX_CARRY_VALUES, MAX_TOP_LOGPROBS

if TYPE_CHECKING:
    from slipstream.runtime.device import Event

POISON = -7
MAX_GROUPS = 2


class SlotState(enum.Enum):
    FREE = "free"
    IN_FLIGHT = "in_flight"


class StepSlot:
    def __init__(self, index: int, device, max_samples: int, vocab_size: int):
        self.index = index
        self.state = SlotState.FREE
        self.step_id = -1
        # [max_samples] sampled ids, then the stamp: one buffer, so one copy carries both
        self.sampled_and_stamp = torch.zeros(max_samples + 1, dtype=torch.int64, device=device.torch_device)
        self.sampled, self.stamp = self.sampled_and_stamp[:max_samples], self.sampled_and_stamp[max_samples:]
        self.stamp.fill_(-1)
        self.host_sampled_and_stamp = device.host_buffer((max_samples + 1,), torch.int64)
        self.host_sampled = self.host_sampled_and_stamp[:max_samples]
        self.host_stamp = self.host_sampled_and_stamp[max_samples:]
        self.host_sampled_and_stamp.fill_(POISON)
        self.logprobs = torch.zeros(max_samples, dtype=torch.float32, device=device.torch_device)
        self.host_logprobs = device.host_buffer((max_samples,), torch.float32)
        # top_logprobs alternatives (SamplingParams.top_logprobs): copied only for steps that want them
        self.top_values = torch.zeros(max_samples, MAX_TOP_LOGPROBS, dtype=torch.float32, device=device.torch_device)
        self.top_ids = torch.zeros(max_samples, MAX_TOP_LOGPROBS, dtype=torch.int64, device=device.torch_device)
        self.host_top_values = device.host_buffer((max_samples, MAX_TOP_LOGPROBS), torch.float32)
        self.host_top_ids = device.host_buffer((max_samples, MAX_TOP_LOGPROBS), torch.int64)
        self.top_k = 0  # the largest top_logprobs of the current step's rows (0: none)
        # a carry step's (kind, values...) per sampling row (runtime/carry.py), copied with its tokens
        self.carry_out = torch.zeros(max_samples, 1 + MAX_CARRY_VALUES, dtype=torch.float32,
                                     device=device.torch_device)
        self.host_carry = device.host_buffer((max_samples, 1 + MAX_CARRY_VALUES), torch.float32)
        self.carry_step = False  # the current step has a row with carry tokens
        self.hidden: torch.Tensor | None = None  # a carry step's hidden states of its sample rows
        self.sample_rows_host: np.ndarray | None = None  # the current step's sampling rows
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
        self.sample_rows: torch.Tensor | None = None  # device view: the step's rows receiving samples
        self.groups = 0  # sampling groups launched for the current step
        self.logits: torch.Tensor | None = None  # written by the forward, read by sampling
        self.num_samples = 0
        self.sample_done: Event | None = None  # events of the step currently in this slot
        self.copy_done: Event | None = None
        self.sampled_in_graph = False  # its decode graph sampled every row (ModelRunner.forward_greedy)

    @property
    def is_free(self) -> bool:
        return self.state is SlotState.FREE

    def acquire(self, step_id: int) -> None:
        if self.state is not SlotState.FREE:
            raise SlotReuseError(
                f"slot {self.index} relaunched for step {step_id} while step {self.step_id} "
                "has not been committed (its host landing buffer may still be receiving a copy)"
            )
        self.state = SlotState.IN_FLIGHT
        self.step_id = step_id
        self.sample_done = self.copy_done = None
        self.sampled_in_graph = False
        self.groups = 0
        self.top_k = 0
        self.carry_step = False

    def stage_group(self, rows, bitmask) -> int:
        """Write one sampling group's row indices (and masks) into its host buffers; returns the group."""
        g = self.groups
        if g >= MAX_GROUPS:
            raise PipelineInvariantError(f"slot {self.index}: more than {MAX_GROUPS} sampling groups in one step")
        self.groups += 1
        k = len(rows)
        self.group_host[g].numpy()[:k] = rows
        if bitmask is not None:
            self.mask_host[g, :k].numpy()[:] = bitmask
        return g

    def read_host(self) -> tuple[list[int], list[float]]:
        """Sampled ids and their logprobs of the step in this slot; valid once copy_done completed."""
        if self.state is not SlotState.IN_FLIGHT or self.copy_done is None or not self.copy_done.query():
            raise PipelineInvariantError(f"slot {self.index}: host buffer read before its copy landed")
        ids = self.host_sampled[: self.num_samples].tolist()
        if POISON in ids:
            raise PipelineInvariantError(f"slot {self.index}: poisoned token read (copy did not land)")
        stamp = int(self.host_stamp[0])
        if self.num_samples and stamp != self.step_id:
            raise PipelineInvariantError(f"slot {self.index}: step {self.step_id} read tokens stamped by step {stamp} "
                                         "(its sampling never ran: stale device buffer)")
        self.host_sampled[: self.num_samples].fill_(POISON)
        self.host_stamp.fill_(POISON)
        return ids, self.host_logprobs[: self.num_samples].tolist()

    def release(self) -> None:
        if self.state is not SlotState.IN_FLIGHT:
            raise PipelineInvariantError(f"slot {self.index} released twice")
        self.state = SlotState.FREE
        self.logits = self.hidden = None

    def abandon(self) -> None:
        """Free the slot of a failed step without reading it (the device has drained)."""
        self.host_sampled_and_stamp.fill_(POISON)
        self.release()

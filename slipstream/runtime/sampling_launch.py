"""Launching a step's sampling: the ModelRunner's part that turns logits into tokens on the device.

At launch for the rows that need nothing from the host, at finalize for the rest (grammar rows,
whose masks need the previous token): each group of rows is sampled exactly once, from the rows'
parameters in the row tables (sampler.sample_group), then the step's device→host copy. A step that
its greedy decode graph sampled already only gets its stamp. Private to the ModelRunner.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from slipstream.errors import PipelineInvariantError
from slipstream.runtime.batch import ForwardInput
from slipstream.runtime.step_slot import StepSlot
from slipstream.runtime.device import Device
from slipstream.runtime.carry import sample_carry
from slipstream.runtime.host_copy import copy_to_device, copy_to_host
from slipstream.runtime.logits_process import top_logprobs
from slipstream.runtime.row_tables import RowTables
from slipstream.runtime.sampler import sample_group
from slipstream.runtime.sampling_args import GroupNeeds

if TYPE_CHECKING:
    from slipstream.faults import FaultInjector


class SamplingLauncher:
    """Enqueues sampling groups and the device→host copy of a step on `device`'s streams."""

    def __init__(self, device: Device, rows: RowTables, model: Any = None):
        self.device, self.rows = device, rows
        self.model = model  # its `carry_heads`, read by carry steps (runtime/carry.py)
        self.faults: FaultInjector | None = None  # tests only (set through ModelRunner.faults)

    def launch(self, slot: StepSlot, packed: ForwardInput, rows: list[int] | None = None,
               bitmask: np.ndarray | None = None, final: bool = True) -> None:
        """Enqueue sampling of some of the step's sampling rows; with `final`, also the D2H copy.

        rows:    indices into the step's sampling rows (None: all of them). Each row is sampled
                 exactly once per step, so groups never overlap.
        bitmask: packed int32 [len(rows), ceil(V/32)] allowed-token masks for these rows, or
                 None. Staged with the group's row indices in the slot's host buffers and
                 uploaded on the upload stream; sampling waits on that upload, nothing else.
        final:   the last group of the step: the device→host copy of all its tokens follows,
                 anchored to an event recorded right after the last sampling.
        Per-row parameters come from the row tables; the host only decides what the group needs
        (from its mirrors, vectorised) and never loops over rows.
        """
        if slot.sampled_in_graph:  # the greedy decode graph sampled every row already
            if rows is not None or bitmask is not None or not final:
                raise PipelineInvariantError(f"step {slot.step_id} was sampled in its graph; got a sampling group")
            self._launch_stamp(slot)
        elif packed.num_samples if rows is None else len(rows):
            self._launch_group(slot, packed, rows, bitmask, final)
        if final:
            self._launch_copy(slot, packed.num_samples)

    def _check_fault(self, step_id: int) -> None:
        if self.faults is not None:
            self.faults.check("sample", step_id)

    def _launch_stamp(self, slot: StepSlot) -> None:
        step_id = slot.step_id

        def stamp() -> None:
            self._check_fault(step_id)
            slot.stamp.fill_(step_id)

        self.device.compute.launch(stamp, "sample")

    def _launch_group(self, slot: StepSlot, packed: ForwardInput, rows: list[int] | None,
                      bitmask: np.ndarray | None, final: bool) -> None:
        host_rows = packed.sample_rows if rows is None else packed.sample_rows[rows]
        needs = self.rows.sampling.needs(host_rows)
        slot.top_k = max(slot.top_k, needs.top_logprobs)
        k = len(host_rows)
        g = slot.stage_group(np.arange(k) if rows is None else rows, bitmask)
        self._upload_group(slot, g, k, bitmask is not None)
        step_id, sample_rows = slot.step_id, slot.sample_rows
        assert sample_rows is not None  # (set by the step's launch_forward)

        def sample() -> None:
            self._check_fault(step_id)
            self._sample_group(slot, sample_rows, g, k, needs, bitmask is not None)
            if final:  # the last group of a sampling step: proof that its sampling ran
                slot.stamp.fill_(step_id)

        self.device.compute.launch(sample, "sample")

    def _sample_group(self, slot: StepSlot, sample_rows: torch.Tensor, g: int, k: int, needs: GroupNeeds,
                      masked: bool) -> None:
        """On the compute stream: group `g` of `k` sampling rows, from the slot's logits to its tokens."""
        t = self.rows
        idx = slot.group_dev[g, :k]
        rows = sample_rows.index_select(0, idx)
        assert slot.logits is not None  # (written by the step's forward, earlier on this stream)
        raw = slot.logits.index_select(0, idx)
        args = t.sampling.gather(rows, needs)
        history = t.history.gather(rows) if args.needs_history and t.history is not None else None
        ids = sample_group(raw, args, history, slot.mask_dev[g, :k] if masked else None)
        t.sampling.advance(rows, args)
        slot.sampled.index_copy_(0, idx, ids)
        t.last_token.index_copy_(0, rows, ids)
        if args.penalties is not None and t.history is not None:  # what the next step's penalties count
            t.history.record(rows, ids)
        if needs.carry:  # the values its carry tokens start, from this step's hidden states
            if slot.hidden is None:
                raise PipelineInvariantError(f"step {slot.step_id}: a carry row was sampled without hidden states")
            out = sample_carry(t, self.model.carry_heads, rows, ids, slot.hidden.index_select(0, idx))
            slot.carry_out.index_copy_(0, idx, out)
        if needs.logprobs:  # of the model's own distribution, before penalties, masks and temperature
            lp = raw.log_softmax(-1)
            slot.logprobs.index_copy_(0, idx, lp.gather(1, ids[:, None])[:, 0])
            if needs.top_logprobs:
                values, top_ids = top_logprobs(raw, needs.top_logprobs)
                slot.top_values[idx, :needs.top_logprobs] = values
                slot.top_ids[idx, :needs.top_logprobs] = top_ids

    def _launch_copy(self, slot: StepSlot, n: int) -> None:
        compute, copy = self.device.compute, self.device.copy
        slot.sample_done = done = compute.record()
        copy.wait(done)  # the copy waits for exactly this step's outputs
        top, carry = slot.top_k, slot.carry_step

        def copy_out() -> None:
            if n:
                copy_to_host(slot.host_sampled_and_stamp, slot.sampled_and_stamp)
                copy_to_host(slot.host_logprobs[:n], slot.logprobs[:n])
                if carry:  # only the rows' own (kind, values): never read back by a later step
                    copy_to_host(slot.host_carry[:n], slot.carry_out[:n])
                if top:  # whole rows: [:n, :top] would be a strided view (host_copy.py)
                    copy_to_host(slot.host_top_values[:n], slot.top_values[:n])
                    copy_to_host(slot.host_top_ids[:n], slot.top_ids[:n])

        copy.launch(copy_out, "d2h")
        slot.copy_done = copy.record()

    def _upload_group(self, slot: StepSlot, g: int, k: int, masked: bool) -> None:
        if self.device.unified_memory:
            return
        upload = self.device.upload

        def h2d() -> None:
            copy_to_device(slot.group_dev[g, :k], slot.group_host[g, :k])
            if masked:
                copy_to_device(slot.mask_dev[g, :k], slot.mask_host[g, :k])

        upload.launch(h2d, "h2d")
        self.device.compute.wait(upload.record())

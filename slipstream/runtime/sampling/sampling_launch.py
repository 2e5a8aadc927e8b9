"""Launching a step's sampling groups: the ModelRunner's part that turns logits into tokens on the
device, for steps whose sampling is more than its forward's argmax.

At launch for the rows that need nothing from the host, at finalize for the rest (grammar rows,
whose masks need the previous token): each group of rows is sampled exactly once, from the rows'
parameters in the row tables (sampler.sample_group); the final group writes the step's stamp. A
group of every row reads the logits and the step's rows in place: no index lists. A group whose
rows are all plain greedy (what the host mirrors say, `GroupNeeds.plain_greedy`) is
`RowTables.greedy`. A step that is all plain greedy and unmasked never comes here: the runner
samples it right behind its forward (or its greedy decode graph did), and launches every step's
copy to the host itself. Private to the ModelRunner.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from slipstream.errors import PipelineInvariantError
from slipstream.runtime.step.carry import sample_carry
from slipstream.runtime.devices.device import Device
from slipstream.runtime.devices.host_copy import copy_to_device
from slipstream.runtime.sampling.logits_process import top_logprobs
from slipstream.runtime.step.row_tables import RowTables
from slipstream.runtime.sampling.sampler import sample_group
from slipstream.runtime.sampling.sampling_args import GroupNeeds
from slipstream.runtime.step.step_slot import LaunchedStep

if TYPE_CHECKING:
    from slipstream.faults import FaultInjector


class SamplingLauncher:
    """Enqueues a step's sampling groups on `device`'s compute stream."""

    def __init__(self, device: Device, rows: RowTables, model: Any = None):
        self.device, self.rows = device, rows
        self.model = model  # its `carry_heads`, read by carry steps (runtime/step/carry.py)
        self.faults: FaultInjector | None = None  # tests only (set through ModelRunner.faults)

    def launch(self, step: LaunchedStep, rows: list[int] | None = None, bitmask: np.ndarray | None = None,
               final: bool = True) -> None:
        """Enqueue sampling of some of the step's sampling rows (ModelRunner.launch_sampling; the
        runner launches the copy after the final group).

        rows:    indices into the step's sampling rows (None: all of them). Each row is sampled
                 exactly once per step, so groups never overlap.
        bitmask: packed int32 [len(rows), ceil(V/32)] allowed-token masks for these rows, or
                 None. Staged with the group's row indices in the slot's host buffers and
                 uploaded on the upload stream; sampling waits on that upload, nothing else.
        final:   the last group of the step: it writes the step's stamp.
        Per-row parameters come from the row tables; the host only decides what the group needs
        (from its mirrors, vectorised) and never loops over rows.
        """
        if step.staged.sampled_in_graph:
            raise PipelineInvariantError(f"step {step.step_id} was sampled in its graph; got a sampling group")
        if step.num_samples if rows is None else len(rows):
            self._launch_group(step, rows, bitmask, final)
        elif final:
            self._launch_item(step, None, final=True)

    def check_fault(self, step_id: int) -> None:
        if self.faults is not None:
            self.faults.check("sample", step_id)

    def _launch_item(self, step: LaunchedStep, work, final: bool) -> None:
        """A sampling item on the compute stream: `work` (a group's sampling, or nothing), and for the
        step's final one its stamp."""
        step_id = step.step_id

        def sample() -> None:
            self.check_fault(step_id)
            if work is not None:
                work()
            if final:
                step.slot.stamp.fill_(step_id)  # proof that this step's sampling ran, in the same copy

        self.device.compute.launch(sample, "sample")

    def _launch_group(self, step: LaunchedStep, rows: list[int] | None, bitmask: np.ndarray | None,
                      final: bool) -> None:
        staged = step.staged
        if rows is None:
            needs, k, g = staged.needs, step.num_samples, None
        else:
            needs, k = self.rows.sampling.needs(staged.packed.sample_rows[rows]), len(rows)
            g = step.next_group()
            step.slot.stage_group(g, rows, bitmask)
            self._upload_group(step, g, k, bitmask is not None)
        step.top_k = max(step.top_k, needs.top_logprobs)
        step.logprobs |= needs.logprobs
        masked = bitmask is not None

        self._launch_item(step, lambda: self._sample_group(step, g, k, needs, masked), final)

    def _sample_group(self, step: LaunchedStep, g: int | None, k: int, needs: GroupNeeds, masked: bool) -> None:
        """On the compute stream: `k` sampling rows (group `g` of the slot's staged indices; None:
        every row, in place), from the step's logits to its tokens."""
        t, slot = self.rows, step.slot
        logits = step.logits
        if logits is None:  # (written by the step's forward, earlier on this stream)
            raise PipelineInvariantError(f"step {step.step_id}: sampled before its forward wrote logits")
        step_rows = step.staged.tensors.sample_rows
        if g is None:
            rows, raw, idx = step_rows[:k], logits[:k], None  # (a graph's bucket pads both)
            if needs.plain_greedy:
                t.greedy(raw, rows, slot.sampled)
                return
        else:
            idx = slot.group_dev[g, :k]
            rows, raw = step_rows.index_select(0, idx), logits.index_select(0, idx)
        args = t.sampling.gather(rows, needs)
        history = t.history.gather(rows) if args.needs_history and t.history is not None else None
        ids = sample_group(raw, args, history, slot.mask_dev[g, :k] if masked else None)
        t.sampling.advance(rows, args)
        _put(slot.sampled, idx, ids)
        t.last_token.index_copy_(0, rows, ids)
        if args.penalties is not None and t.history is not None:  # what the next step's penalties count
            t.history.record(rows, ids)
        if needs.carry:  # the values its carry tokens start, from this step's hidden states
            hidden = step.hidden
            if hidden is None:
                raise PipelineInvariantError(f"step {step.step_id}: a carry row was sampled without hidden states")
            _put(slot.carry_out, idx, sample_carry(t, self.model.carry_heads, rows, ids,
                                                    hidden[:k] if idx is None else hidden.index_select(0, idx)))
        if needs.logprobs:  # of the model's own distribution, before penalties, masks and temperature
            lp = raw.log_softmax(-1)
            _put(slot.logprobs, idx, lp.gather(1, ids[:, None])[:, 0])
            if needs.top_logprobs:
                values, top_ids = top_logprobs(raw, needs.top_logprobs)
                at = slice(0, k) if idx is None else idx
                slot.top_values[at, :needs.top_logprobs] = values
                slot.top_ids[at, :needs.top_logprobs] = top_ids

    def _upload_group(self, step: LaunchedStep, g: int, k: int, masked: bool) -> None:
        if self.device.unified_memory:
            return
        upload, slot = self.device.upload, step.slot

        def h2d() -> None:
            copy_to_device(slot.group_dev[g, :k], slot.group_host[g, :k])
            if masked:
                copy_to_device(slot.mask_dev[g, :k], slot.mask_host[g, :k])

        upload.launch(h2d, "h2d")
        self.device.compute.wait(upload.record())


def _put(out: torch.Tensor, idx: torch.Tensor | None, values: torch.Tensor) -> None:
    """out[idx] = values along rows (idx None: the first len(values) rows)."""
    if idx is None:
        out[:values.shape[0]].copy_(values)
    else:
        out.index_copy_(0, idx, values)

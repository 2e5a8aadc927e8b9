"""Launching a step's sampling: the ModelRunner's half that turns logits into tokens on the device.

At launch for the rows that need nothing from the host, at finalize for the rest (grammar rows,
whose masks need the previous token): each group of rows is sampled exactly once, from the rows'
parameters in the row tables (penalties → grammar mask → min_tokens → min_p → sample), then the
step's device→host copy. A step that its greedy decode graph sampled already only gets its stamp.
"""
from __future__ import annotations

import numpy as np

from slipstream.errors import PipelineInvariantError
from slipstream.runtime.batch import PackedStep
from slipstream.runtime.decode_slot import DecodeSlot
from slipstream.runtime.host_copy import copy_to_device, copy_to_host
from slipstream.runtime.logits_process import (ProcessFlags, apply_penalties, min_p_filter, suppress_stop_tokens,
                                               top_logprobs)
from slipstream.runtime.row_tables import FILTERED, LOGPROBS, MIN_P, MIN_TOKENS, PENALIZED, RANDOM, TOP_LOGPROBS
from slipstream.runtime.sampler import GroupFlags, apply_bitmask, sample


class SamplingLauncher:
    """Mixed into ModelRunner: needs its `device`, `rows` (RowTables) and `faults`."""

    def launch_sampling(self, slot: DecodeSlot, packed: PackedStep, rows: list[int] | None = None,
                        bitmask: np.ndarray | None = None, final: bool = True) -> None:
        """Enqueue sampling of some of the step's sampling rows; with `final`, also the D2H copy.

        rows:    indices into the step's sampling rows (None: all of them). Each row is sampled
                 exactly once per step, so groups never overlap.
        bitmask: packed int32 [len(rows), ceil(V/32)] allowed-token masks for these rows, or
                 None. Staged with the group's row indices in the slot's host buffers and
                 uploaded on the upload stream; sampling waits on that upload, nothing else.
        final:   the last group of the step: the device→host copy of all its tokens follows,
                 anchored to an event recorded right after the last sampling.
        Per-row parameters come from the row tables; the host only decides the group's flags
        (from its mirrors, vectorised) and never loops over rows.
        """
        n = packed.num_samples
        compute, copy = self.device.compute, self.device.copy
        step_id = slot.step_id
        k = n if rows is None else len(rows)
        if slot.sampled_in_graph:  # the greedy decode graph sampled every row already
            if rows is not None or bitmask is not None or not final:
                raise PipelineInvariantError(f"step {step_id} was sampled in its graph; got a sampling group")

            def stamp() -> None:
                if self.faults is not None:
                    self.faults.check("sample", step_id)
                slot.stamp.fill_(step_id)

            compute.launch(stamp, "sample")
        elif k:
            carry_host = packed.sample_rows if rows is None else packed.sample_rows[rows]
            t = self.rows
            bits = t.group_flags(carry_host)
            want_logprobs = bool(bits & LOGPROBS)
            flags = GroupFlags(any_random=bool(bits & RANDOM), any_filter=bool(bits & FILTERED))
            extra = ProcessFlags(penalties=bool(bits & PENALIZED), min_tokens=bool(bits & MIN_TOKENS),
                                 min_p=bool(bits & MIN_P),
                                 top_logprobs=int(t.top_logprobs[carry_host].max()) if bits & TOP_LOGPROBS else 0)
            slot.top_k = max(slot.top_k, extra.top_logprobs)
            masked = bitmask is not None
            g = slot.stage_group(np.arange(n) if rows is None else rows, bitmask)
            self._upload_group(slot, g, k, masked)
            sample_rows = slot.sample_rows

            def sample_group() -> None:
                if self.faults is not None:
                    self.faults.check("sample", step_id)
                idx = slot.group_dev[g, :k]
                carry = sample_rows.index_select(0, idx)
                raw = slot.logits.index_select(0, idx)
                temperature, top_p, top_k, seed, out_index = t.gather(
                    ("temperature", "top_p", "top_k", "seed", "output_index"), carry)
                logits = raw  # order: penalties → grammar mask → min_tokens → min_p → sample
                if extra.any_logits_change:
                    presence, frequency, repetition, min_p, min_tokens = t.gather(
                        ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens"), carry)
                    if extra.penalties or extra.min_tokens:
                        counts, prompt_mask, stop_mask = t.history.gather(carry)
                    if extra.penalties:
                        logits = apply_penalties(logits, counts, prompt_mask, presence, frequency, repetition)
                if masked:
                    logits = apply_bitmask(logits, slot.mask_dev[g, :k])
                if extra.min_tokens:
                    logits = suppress_stop_tokens(logits, stop_mask, out_index, min_tokens)
                if extra.min_p:
                    logits = min_p_filter(logits, temperature, min_p)
                ids = sample(logits, temperature, top_k, top_p, seed, out_index, flags)
                t.out_index.index_copy_(0, carry, out_index + 1)
                slot.sampled.index_copy_(0, idx, ids)
                t.token.index_copy_(0, carry, ids)
                if extra.penalties and t.history is not None:  # what the next step's penalties count
                    t.history.record(carry, ids)
                if want_logprobs:  # of the model's own distribution, before penalties, masks and temperature
                    lp = raw.log_softmax(-1)
                    slot.logprobs.index_copy_(0, idx, lp.gather(1, ids[:, None])[:, 0])
                    if extra.top_logprobs:
                        values, top_ids = top_logprobs(raw, extra.top_logprobs)
                        slot.top_values[idx, :extra.top_logprobs] = values
                        slot.top_ids[idx, :extra.top_logprobs] = top_ids
                if final:  # the last group of a sampling step: proof that its sampling ran
                    slot.stamp.fill_(step_id)

            compute.launch(sample_group, "sample")
        if not final:
            return
        slot.sample_done = compute.record()
        copy.wait(slot.sample_done)  # the copy waits for exactly this step's outputs
        top = slot.top_k

        def copy_out() -> None:
            if n:
                copy_to_host(slot.host_sampled_and_stamp, slot.sampled_and_stamp)
                copy_to_host(slot.host_logprobs[:n], slot.logprobs[:n])
                if top:  # whole rows: [:n, :top] would be a strided view (host_copy.py)
                    copy_to_host(slot.host_top_values[:n], slot.top_values[:n])
                    copy_to_host(slot.host_top_ids[:n], slot.top_ids[:n])

        copy.launch(copy_out, "d2h")
        slot.copy_done = copy.record()

    def _upload_group(self, slot: DecodeSlot, g: int, k: int, masked: bool) -> None:
        if self.device.unified_memory:
            return
        upload = self.device.upload

        def h2d() -> None:
            copy_to_device(slot.group_dev[g, :k], slot.group_host[g, :k])
            if masked:
                copy_to_device(slot.mask_dev[g, :k], slot.mask_host[g, :k])

        upload.launch(h2d, "h2d")
        self.device.compute.wait(upload.record())

"""A speculating step's layout on its way to the device without a blocking copy (`SpecStaging`, one per
slot), and what a speculating graph reads (`FixedLayout`): speculation/runner.py's inputs where the
device's memory is not the host's (CUDA; docs/speculative.md, "Speculating steps from graphs")."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from slipstream.runtime.devices.host_copy import copy_to_device
from slipstream.speculation.verify import SpecLayout, layout_arrays


class SpecStaging:
    """One slot's host->device staging of a speculating step's layout (the host's k per row, what
    the device runs where its shape cannot follow the device: CUDA): a host buffer (pinned on CUDA)
    and its device twin, each array at a fixed offset, uploaded in one non-blocking copy on the
    upload stream that the compute stream waits for — as `StepArena` stages a plain step, so the
    launch never waits for the step in flight. The buffer is the slot's: it is rewritten only when
    the slot takes its next step, after this one's commit, by which time the copy has long landed
    (a pinned buffer rewritten while its copy is in flight would feed the step the next one's layout)."""

    def __init__(self, device, max_rows: int, max_drafts: int):
        r, t = max_rows, max_rows * (max_drafts + 1)
        self.device, self.max_drafts = device, max_drafts
        self.offsets: dict[str, int] = {}
        at = 0
        regions = (("num_drafts", r), ("owner", t), ("offset", t), ("start", r), ("query_start", r + 1), ("fixed_k", r))
        for name, size in regions:
            self.offsets[name] = at
            at += size
        self.host = device.host_buffer((at,), torch.int64)
        self.host.zero_()
        self.host_np = self.host.numpy()
        self.dev = self.host if device.unified_memory else torch.zeros(at, dtype=torch.int64,
                                                                         device=device.torch_device)

    def _put(self, name: str, values: np.ndarray) -> torch.Tensor:
        at = self.offsets[name]
        self.host_np[at:at + len(values)] = values
        return self.dev[at:at + len(values)]

    def stage(self, k: np.ndarray) -> tuple[SpecLayout, torch.Tensor, int]:
        """(layout, query starts [n + 1], positions) of k drafts per row, as device views, their
        upload enqueued. Vectorised numpy; nothing here reads the device."""
        k, owner, offset, start, width = layout_arrays(k, self.max_drafts)
        query_start = np.concatenate([start, [len(owner)]])
        views = [self._put(name, a) for name, a in (("num_drafts", k), ("owner", owner), ("offset", offset),
                                                    ("start", start), ("query_start", query_start))]
        if not self.device.unified_memory:
            n = self.offsets["query_start"] + len(query_start)  # (the used prefix: one copy)

            def h2d() -> None:
                copy_to_device(self.dev[:n], self.host[:n])

            self.device.upload.launch(h2d, "h2d")
            self.device.compute.wait(self.device.upload.record())
        return SpecLayout(views[0], views[1], views[2], views[3], width), views[4], len(owner)

    def fixed_k(self, rows: int) -> torch.Tensor:
        """The device view a graph of `rows` reads its rows' draft counts from (a fixed address)."""
        at = self.offsets["fixed_k"]
        return self.dev[at:at + rows]

    def stage_fixed(self, k: np.ndarray, rows: int) -> None:
        """A graphed step's draft counts, padded with 0 to its bucket of `rows`, and their upload."""
        at = self.offsets["fixed_k"]
        self.host_np[at:at + len(k)] = k
        self.host_np[at + len(k):at + rows] = 0
        if not self.device.unified_memory:
            def h2d() -> None:
                copy_to_device(self.dev[at:at + rows], self.host[at:at + rows])

            self.device.upload.launch(h2d, "h2d")
            self.device.compute.wait(self.device.upload.record())


class FixedLayout(NamedTuple):
    """What a speculating graph of B rows reads: the fixed-k layout, every row K + 1 positions (row i
    at i(K + 1) .. i(K + 1) + K) whatever its k, so every shape is the bucket's (docs/speculative.md,
    "Speculating steps from graphs"). Only `rows` (the slot's decode-row view, padded with row 0) and
    the counts in `lay.num_drafts` (SpecStaging.fixed_k) change from step to step."""

    rows: torch.Tensor  # [B]
    lay: SpecLayout  # num_drafts [B] staged; owner, offset, start constant
    query_start: torch.Tensor  # [B + 1] constant: i(K + 1)
    sample_indices: torch.Tensor  # [B(K + 1)] constant: every position's logits

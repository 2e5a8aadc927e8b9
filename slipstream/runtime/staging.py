"""Step inputs staged through one host buffer per slot and uploaded with a single copy.

Every integer array a step needs (token ids, carry-over rows, positions, KV slot mapping, sample
rows, attention metadata, page tables) is written into the slot's host arena at fixed offsets,
and one host→device copy of the used prefix moves it to the slot's device arena. Why:
  - on CUDA the host arena is pinned, so the copy is background DMA on the upload stream; a copy
    from pageable memory would make the host wait for the stream (a hidden sync);
  - offsets never move, so a captured graph can read its inputs from the same addresses every
    replay (views of the device arena are the graph's static inputs);
  - on the CPU, host and device arena are one tensor and nothing is copied.
The arena belongs to its DecodeSlot, so it is rewritten only after the slot's previous step was
committed — by then its upload has long been consumed by that step's forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.runtime.batch import SCRATCH_PAGE, PackedStep


@dataclass(frozen=True)
class StepTensors:
    """Device views of one step's inputs (shapes are the step's own, or its bucket's)."""

    input_ids: torch.Tensor
    from_device: torch.Tensor  # int64 0/1
    carry_rows: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    sample_indices: torch.Tensor
    query_start: torch.Tensor
    kv_lens: torch.Tensor
    page_table: torch.Tensor  # [seqs, max_pages]
    max_q_len: int


class StepArena:
    """Host + device int64 buffers of one slot, laid out for the largest step the engine plans."""

    FIELDS = ("input_ids", "from_device", "carry_rows", "positions", "slot_mapping")

    def __init__(self, device, max_tokens: int, max_seqs: int, max_pages: int, page_size: int):
        self.device, self.page_size = device, page_size
        self.max_tokens, self.max_seqs, self.max_pages = max_tokens, max_seqs, max_pages
        t, s = max_tokens, max_seqs
        self.offsets: dict[str, int] = {}
        at = 0
        for name, size in [(f, t) for f in self.FIELDS] + [("sample_indices", t), ("query_start", s + 1),
                                                          ("kv_lens", s), ("page_table", s * max_pages)]:
            self.offsets[name] = at
            at += size
        self.size = at
        self.host = device.host_buffer((at,), torch.int64)
        self.host.zero_()
        self.host_np = self.host.numpy()
        if device.unified_memory:
            self.dev = self.host
        else:
            self.dev = torch.zeros(at, dtype=torch.int64, device=device.torch_device)

    def _view(self, buf: np.ndarray | torch.Tensor, name: str, n: int):
        at = self.offsets[name]
        return buf[at : at + n]

    def fill(self, packed: PackedStep, pad_seqs: int = 0) -> tuple[int, int, int, int]:
        """Write `packed` into the host arena; `pad_seqs` > 0 pads a decode step to that many one-token
        sequences (a graph bucket). Returns (tokens, seqs, samples, max_q_len) as laid out, padding
        included: the arguments of `tensors`."""
        h = self.host_np
        n_tok = len(packed.input_ids)
        n_seq = len(packed.kv_lens)
        n_smp = len(packed.sample_indices)
        if pad_seqs:
            n_tok = n_seq = n_smp = max(pad_seqs, n_seq)
        if n_tok > self.max_tokens or n_seq > self.max_seqs or n_smp > self.max_tokens:
            raise ValueError(f"step of {n_tok} tokens / {n_seq} sequences exceeds the staging layout "
                             f"({self.max_tokens} / {self.max_seqs})")
        for name in self.FIELDS:
            view = self._view(h, name, n_tok)
            src = getattr(packed, name)
            view[: len(src)] = src
            view[len(src):] = 0
        slots = self._view(h, "slot_mapping", n_tok)
        slots[len(packed.slot_mapping):] = SCRATCH_PAGE * self.page_size
        smp = self._view(h, "sample_indices", n_smp)
        smp[: len(packed.sample_indices)] = packed.sample_indices
        smp[len(packed.sample_indices):] = np.arange(len(packed.sample_indices), n_smp) if pad_seqs else 0
        qs = self._view(h, "query_start", n_seq + 1)
        qs[: len(packed.query_start)] = packed.query_start
        qs[len(packed.query_start):] = packed.query_start[-1] + np.arange(1, n_seq + 2 - len(packed.query_start))
        kv = self._view(h, "kv_lens", n_seq)
        kv[: len(packed.kv_lens)] = packed.kv_lens
        kv[len(packed.kv_lens):] = 1  # padding sequences see one key: their own, on the scratch page
        pt = self._view(h, "page_table", self.max_seqs * self.max_pages).reshape(self.max_seqs, self.max_pages)
        for i, pages in enumerate(packed.page_tables):
            if len(pages) > self.max_pages:
                raise ValueError(f"sequence with {len(pages)} pages exceeds the staging layout ({self.max_pages})")
            pt[i, : len(pages)] = pages
        pt[len(packed.page_tables): n_seq, 0] = SCRATCH_PAGE
        self._used = self.offsets["page_table"] + n_seq * self.max_pages
        q = np.diff(packed.query_start)
        return n_tok, n_seq, n_smp, int(q.max()) if len(q) else 1

    def upload(self) -> None:
        """Copy the used prefix host→device on the upload stream; the compute stream waits for it."""
        if self.device.unified_memory:
            return
        n = self._used

        def h2d() -> None:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)

        self.device.upload.launch(h2d, "h2d")
        self.device.compute.wait(self.device.upload.record())

    def tensors(self, n_tok: int, n_seq: int, n_smp: int, max_q_len: int) -> StepTensors:
        d = self.dev
        return StepTensors(
            *(self._view(d, f, n_tok) for f in self.FIELDS),
            sample_indices=self._view(d, "sample_indices", n_smp),
            query_start=self._view(d, "query_start", n_seq + 1),
            kv_lens=self._view(d, "kv_lens", n_seq),
            page_table=self._view(d, "page_table", self.max_seqs * self.max_pages)
            .view(self.max_seqs, self.max_pages)[:n_seq],
            max_q_len=max_q_len,
        )


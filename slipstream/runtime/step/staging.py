"""Step inputs staged through one host buffer per slot and uploaded with a single copy.

What a step sends (slipstream/runtime/batch.py): the decode rows, the chunks' tokens/positions/
rows, the step's per-sequence query offsets, its sample indices and rows, new page-table entries,
and the chunks' sampling parameters. Each goes at a fixed offset of the slot's host arena (int64,
plus a small float32 arena for parameters) and one host→device copy of the used prefix moves it.
  - on CUDA the host arenas are pinned, so the copy is background DMA on the upload stream; a copy
    from pageable memory would make the host wait for the stream (a hidden sync);
  - offsets never move, so a captured graph reads its inputs from the same addresses every replay;
  - on the CPU, host and device arena are one tensor and nothing is copied;
  - a step replayed by a mixed graph also fills the fixed-shape regions of its token bucket
    (slipstream/runtime/graphs/static_step.py), which sit after the rest and travel as a second copy.
For a step of N decoding rows the host writes N row ids and N+1 query offsets (numpy slices, no
Python per row). The arena belongs to its StepSlot, so it is rewritten only after the slot's
previous step was committed — by then that step's forward has long consumed its upload.
Private to the ModelRunner: the scheduler hands it a ForwardInput and never sees these types.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slipstream.runtime.batch import ForwardInput
from slipstream.runtime.devices.host_copy import copy_to_device
from slipstream.runtime.sampling.sampling_args import NUM_FLOATS, NUM_INTS, stage_params
from slipstream.runtime.graphs.static_step import static_regions


@dataclass(frozen=True)
class StepTensors:
    """Device views of one step's inputs (shapes are the step's own, or its bucket's)."""

    decode_rows: torch.Tensor  # [d]
    chunk_ids: torch.Tensor  # [Tc] (chunk tokens, then padding)
    chunk_pos: torch.Tensor
    chunk_token_rows: torch.Tensor
    chunk_rows: torch.Tensor  # [c]
    chunk_ends: torch.Tensor  # [c]
    query_start: torch.Tensor  # [d + c + 1]
    sample_indices: torch.Tensor  # [n + padding]
    sample_rows: torch.Tensor  # [n]
    max_q_len: int
    decode_only: bool = False  # no chunk tokens (nor padding tokens): the decode rows are the whole step
    # row 0 may be among its sequences (padding): the step resets its position. Always for a graph's
    # layout (captured on an all-padding step); only an eager step without padding leaves it out
    scratch: bool = True


@dataclass(frozen=True)
class RowUpdates:
    """Row-table writes a step applies before its forward: page-table entries, chunk parameters."""

    page_writes: torch.Tensor  # [w, 3]
    param_rows: torch.Tensor  # [c]
    params_int: torch.Tensor  # [NUM_INTS, c] (sampling_args.stage_params)
    params_float: torch.Tensor  # [NUM_FLOATS, c]


@dataclass(frozen=True)
class Layout:
    """Sizes of a staged step, padding included: what `tensors` and `updates` slice."""

    d: int
    tc: int
    c: int
    n: int
    n_pad: int
    w: int
    max_q_len: int
    pad_rows: int = 0  # decode rows of padding (row 0) after the step's own

    @classmethod
    def decode_bucket(cls, rows: int) -> "Layout":
        """A decode-only step padded to `rows`: what a captured graph of that bucket reads."""
        return cls(d=rows, tc=0, c=0, n=rows, n_pad=rows, w=0, max_q_len=1, pad_rows=rows)


class StepArena:
    """Host + device buffers of one slot, laid out for the largest step the engine plans."""

    def __init__(self, device, max_tokens: int, max_seqs: int, max_pages: int):
        self.device = device
        self.max_tokens, self.max_seqs, self.max_pages = max_tokens, max_seqs, max_pages
        t, s = max_tokens, max_seqs
        sizes = [("decode_rows", s), ("chunk_ids", t), ("chunk_pos", t), ("chunk_token_rows", t),
                 ("chunk_rows", s), ("chunk_ends", s), ("query_start", s + 1), ("sample_indices", t),
                 ("sample_rows", t), ("params_int", NUM_INTS * s), ("page_writes", 3 * s * max_pages)]
        # the fixed-shape layout of mixed-step graphs (static_step.py), uploaded as a second range
        static = static_regions(max_tokens, max_seqs)
        sizes += static
        self.offsets: dict[str, int] = {}
        at = 0
        for name, size in sizes:
            self.offsets[name] = at
            at += size
        self.host = device.host_buffer((at,), torch.int64)
        self.host.zero_()
        self.host_np = self.host.numpy()
        self.host_f = device.host_buffer((NUM_FLOATS * s,), torch.float32)
        self.host_f_np = self.host_f.numpy()
        if device.unified_memory:
            self.dev, self.dev_f = self.host, self.host_f
        else:
            self.dev = torch.zeros(at, dtype=torch.int64, device=device.torch_device)
            self.dev_f = torch.zeros_like(self.host_f, device=device.torch_device)
        self._used = 0
        self._used_f = 0
        self._static_range = (self.offsets[static[0][0]], at)
        self._static_used = False

    def host_region(self, name: str, n: int) -> np.ndarray:
        at = self.offsets[name]
        return self.host_np[at:at + n]

    def dev_region(self, name: str, n: int) -> torch.Tensor:
        at = self.offsets[name]
        return self.dev[at:at + n]

    def mark_static_used(self) -> None:
        """The static regions were written for this step: `upload` copies them too."""
        self._static_used = True

    def _put(self, name: str, values: np.ndarray, pad_to: int = 0, pad_value: int = 0) -> None:
        at = self.offsets[name]
        n = len(values)
        self.host_np[at:at + n] = values
        if pad_to > n:
            self.host_np[at + n:at + pad_to] = pad_value
        self._used = max(self._used, at + max(n, pad_to))

    def fill(self, packed: ForwardInput, pad_decode: int = 0) -> Layout:
        """Write `packed` into the host arenas; `pad_decode` > 0 pads a decode-only step to that many
        rows (a graph bucket) with the scratch row. Returns the layout `tensors`/`updates` take."""
        d = max(packed.num_decode, pad_decode)
        tc, c = len(packed.chunk_ids), len(packed.chunk_rows)
        n = packed.num_samples + (d - packed.num_decode)
        n_pad = n + packed.pad_samples
        w = len(packed.page_writes)
        if d + tc > self.max_tokens or d + c > self.max_seqs or n_pad > self.max_tokens \
                or w > self.max_seqs * self.max_pages:
            raise ValueError(f"step of {d + tc} tokens / {d + c} sequences / {w} page writes exceeds the "
                             f"staging layout ({self.max_tokens} / {self.max_seqs} / {self.max_seqs * self.max_pages})")
        self._used = 0
        self._static_used = False
        self._put("decode_rows", packed.decode_rows, d)
        self._put("chunk_ids", packed.chunk_ids)
        self._put("chunk_pos", packed.chunk_pos)
        self._put("chunk_token_rows", packed.chunk_token_rows)
        self._put("chunk_rows", packed.chunk_rows)
        self._put("chunk_ends", packed.chunk_ends)
        self._put("query_start", np.concatenate([np.arange(d + 1), d + packed.chunk_query_start[1:]]))
        sample_idx = np.concatenate([np.arange(d), packed.chunk_sample_index])
        self._put("sample_indices", sample_idx, n_pad)
        self._put("sample_rows", np.concatenate([packed.sample_rows[:packed.num_decode],
                                                 np.zeros(d - packed.num_decode, np.int64),
                                                 packed.sample_rows[packed.num_decode:]]))
        if w:
            self._put("page_writes", packed.page_writes.reshape(-1))
        self._used_f = 0
        if c:
            at = self.offsets["params_int"]
            ints = self.host_np[at:at + NUM_INTS * c].reshape(NUM_INTS, c)
            floats = self.host_f_np[:NUM_FLOATS * c].reshape(NUM_FLOATS, c)
            stage_params(packed.chunks, ints, floats)
            self._used = max(self._used, at + NUM_INTS * c)
            self._used_f = NUM_FLOATS * c
        return Layout(d, tc, c, n, n_pad, w, packed.max_query_len, d - packed.num_decode)

    def stage_writes(self, writes: np.ndarray) -> RowUpdates:
        """Only the page-table entries of a step whose other inputs this arena holds already (the
        same decode rows as its last step): written, uploaded, and the updates that apply them."""
        w = len(writes)
        at = self.offsets["page_writes"]
        self.host_np[at:at + 3 * w] = writes.reshape(-1)
        if not self.device.unified_memory:
            def h2d() -> None:
                copy_to_device(self.dev[at:at + 3 * w], self.host[at:at + 3 * w])

            self.device.upload.launch(h2d, "h2d")
            self.device.compute.wait(self.device.upload.record())
        return self.updates(Layout(d=0, tc=0, c=0, n=0, n_pad=0, w=w, max_q_len=1))

    def upload(self) -> None:
        """Copy the used prefixes host→device on the upload stream; the compute stream waits for it."""
        if self.device.unified_memory:
            return
        n, nf = self._used, self._used_f
        lo, hi = self._static_range if self._static_used else (0, 0)

        def h2d() -> None:
            copy_to_device(self.dev[:n], self.host[:n])
            if hi:
                copy_to_device(self.dev[lo:hi], self.host[lo:hi])
            if nf:
                copy_to_device(self.dev_f[:nf], self.host_f[:nf])

        self.device.upload.launch(h2d, "h2d")
        self.device.compute.wait(self.device.upload.record())

    def _view(self, name: str, n: int) -> torch.Tensor:
        at = self.offsets[name]
        return self.dev[at:at + n]

    def tensors(self, lay: Layout) -> StepTensors:
        v = self._view
        return StepTensors(
            decode_rows=v("decode_rows", lay.d), chunk_ids=v("chunk_ids", lay.tc), chunk_pos=v("chunk_pos", lay.tc),
            chunk_token_rows=v("chunk_token_rows", lay.tc), chunk_rows=v("chunk_rows", lay.c),
            chunk_ends=v("chunk_ends", lay.c), query_start=v("query_start", lay.d + lay.c + 1),
            sample_indices=v("sample_indices", lay.n_pad), sample_rows=v("sample_rows", lay.n),
            max_q_len=lay.max_q_len, decode_only=not (lay.tc or lay.c), scratch=bool(lay.pad_rows or lay.tc or lay.c))

    def updates(self, lay: Layout) -> RowUpdates:
        c = lay.c
        return RowUpdates(page_writes=self._view("page_writes", 3 * lay.w).view(lay.w, 3),
                          param_rows=self._view("chunk_rows", c),
                          params_int=self._view("params_int", NUM_INTS * c).view(NUM_INTS, c),
                          params_float=self.dev_f[:NUM_FLOATS * c].view(NUM_FLOATS, c))

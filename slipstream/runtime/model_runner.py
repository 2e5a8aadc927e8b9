"""Runs steps on a device: forward on the compute stream, sampling after it, D2H on the copy stream.

The runner knows nothing about requests. It owns the model, the KV cache, the two DecodeSlots and
the carry-over table `token_table[row]`: sampling scatters each row's new token there, and the
next forward gathers decode inputs from it on the device, so a sampled token never has to visit
the host before it is fed back. Stream order (sampling of step t precedes the forward of t+1 on
the compute stream) is what makes that read correct.

Step inputs reach the device through the slot's StepArena (one pinned upload per step). With
`graphs` set (CUDA), a decode-only step replays the captured graph of its slot and bucket:
inputs → layers → logits. Sampling is outside the graph, eager: it varies per row (greedy,
seeded, masked) and its row groups are decided after the forward was launched.
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.intmath import round_up
from slipstream.models.attention import AttentionMetadata, DeviceAttentionMetadata
from slipstream.models.llama import ForwardBatch, KVCache, LlamaForCausalLM
from slipstream.runtime.batch import PackedStep, SeqWork
from slipstream.runtime.decode_slot import DecodeSlot
from slipstream.runtime.graphs import GraphCache
from slipstream.runtime.runner_api import SampledTokens
from slipstream.runtime.sampler import GroupFlags, apply_bitmask, sample
from slipstream.runtime.staging import StepArena, StepTensors


class ModelRunner:
    """Implements slipstream.runtime.runner_api.Runner on a Device."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, device, max_rows: int, max_tokens: int,
                 max_pages: int, num_slots: int = 2, row_multiple: int = 1):
        self.model, self.kv, self.device = model, kv, device
        self.row_multiple = row_multiple  # pad steps so CPU matmul rows do not depend on batch size
        self.token_table = torch.zeros(max_rows, dtype=torch.int64, device=device.torch_device)
        self.slots = [DecodeSlot(i, device, max_rows, model.config.vocab_size) for i in range(num_slots)]
        max_tokens = round_up(max(max_tokens, max_rows), row_multiple)
        self.arenas = [StepArena(device, max_tokens, max_rows, max_pages, kv.page_size) for _ in range(num_slots)]
        self.vocab_size = model.config.vocab_size
        self.graphs: GraphCache | None = None  # CUDA graphs of decode steps (slipstream/runtime/cuda_graphs.py)
        self.faults = None  # tests only: a slipstream.faults.FaultInjector (None: no cost)

    # --- forward --------------------------------------------------------------------------------

    def forward_from(self, t: StepTensors, host_meta: AttentionMetadata | None = None) -> torch.Tensor:
        """The forward on staged inputs; also what a decode graph captures (then `host_meta` is None)."""
        ids = torch.where(t.from_device.bool(), self.token_table[t.carry_rows], t.input_ids)
        meta = host_meta or AttentionMetadata([], [], [], self.kv.page_size)
        meta.on_device = DeviceAttentionMetadata(t.query_start, t.kv_lens, t.page_table, t.max_q_len)
        batch = ForwardBatch(input_ids=ids, positions=t.positions, slot_mapping=t.slot_mapping,
                             sample_indices=t.sample_indices, attn=meta)
        return self.model(batch, self.kv)  # a non-final prefill chunk samples nothing but fills KV

    def launch_forward(self, slot: DecodeSlot, step_id: int, packed: PackedStep) -> None:
        """Enqueue the forward of one step into `slot`; returns at once."""
        slot.acquire(step_id)
        slot.num_samples = packed.num_samples
        arena = self.arenas[slot.index]
        hit = self.graphs.lookup(slot.index, len(packed.kv_lens)) if self._graphable(packed) else None
        if hit is not None:
            bucket, graph = hit
            arena.fill(packed, pad_seqs=bucket)
            arena.upload()

            def forward() -> None:
                if self.faults is not None:
                    self.faults.check("forward", step_id)
                slot.logits = graph.replay()
        else:
            layout = arena.fill(packed)
            arena.upload()
            tensors = arena.tensors(*layout)
            host_meta = AttentionMetadata(packed.query_start, packed.kv_lens, packed.page_tables, self.kv.page_size)

            def forward() -> None:
                if self.faults is not None:
                    self.faults.check("forward", step_id)
                slot.logits = self.forward_from(tensors, host_meta)

        self.device.compute.launch(forward, "forward")

    def _graphable(self, packed: PackedStep) -> bool:
        """Decode-only: one device-fed token per sequence, each sampled (and no CPU row padding)."""
        n = len(packed.kv_lens)
        return (self.graphs is not None and self.row_multiple == 1 and n > 0
                and packed.num_tokens == n == packed.num_samples and bool(packed.from_device[:n].all()))

    # --- sampling (at launch for rows that need nothing from the host, at finalize for the rest) ---

    def launch_sampling(self, slot: DecodeSlot, packed: PackedStep, works: list[SeqWork],
                        rows: list[int] | None = None, bitmask: np.ndarray | None = None,
                        final: bool = True) -> None:
        """Enqueue sampling of some of the step's sampling rows; with `final`, also the D2H copy.

        rows:    indices into the step's sampling rows (None: all of them). Each row is sampled
                 exactly once per step, so groups never overlap.
        bitmask: packed int32 [len(rows), ceil(V/32)] allowed-token masks for these rows, or
                 None. Staged with the group's row indices in the slot's host buffers and
                 uploaded on the upload stream; sampling waits on that upload, nothing else.
        final:   the last group of the step: the device→host copy of all its tokens follows,
                 anchored to an event recorded right after the last sampling.
        """
        n = packed.num_samples
        sampled_works = [w for w in works if w.sample]
        rows = list(range(n)) if rows is None else rows
        compute, copy = self.device.compute, self.device.copy
        step_id = slot.step_id
        if rows:
            params = [sampled_works[i].sampling for i in rows]
            out_idx = [sampled_works[i].output_index for i in rows]
            want_logprobs = any(p.logprobs for p in params)
            flags = GroupFlags(any_random=any(p.temperature > 0 for p in params),
                               any_filter=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1.0) for p in params))
            k, masked = len(rows), bitmask is not None
            g = slot.stage_group(rows, packed.sample_rows[rows], bitmask, params, out_idx)
            self._upload_group(slot, g, k, masked)

            def sample_rows() -> None:
                if self.faults is not None:
                    self.faults.check("sample", step_id)
                idx, carry, top_k, seeds, positions = slot.group_dev[g, :, :k]
                temperature, top_p = slot.group_f_dev[g, :, :k]
                logits = slot.logits.index_select(0, idx)
                if masked:
                    logits = apply_bitmask(logits, slot.mask_dev[g, :k])
                ids = sample(logits, temperature, top_k, top_p, seeds, positions, flags)
                slot.sampled.index_copy_(0, idx, ids)
                self.token_table.index_copy_(0, carry, ids)
                if want_logprobs:  # of the model's own distribution, before masks and temperature
                    raw = slot.logits.index_select(0, idx).log_softmax(-1)
                    slot.logprobs.index_copy_(0, idx, raw.gather(1, ids[:, None])[:, 0])
                if final:  # the last group of a sampling step: proof that its sampling ran
                    slot.stamp.fill_(step_id)

            compute.launch(sample_rows, "sample")
        if not final:
            return
        slot.sample_done = compute.record()
        copy.wait(slot.sample_done)  # the copy waits for exactly this step's outputs

        def copy_out() -> None:
            if n:
                slot.host_sampled_and_stamp.copy_(slot.sampled_and_stamp, non_blocking=True)
                slot.host_logprobs[:n].copy_(slot.logprobs[:n], non_blocking=True)

        copy.launch(copy_out, "d2h")
        slot.copy_done = copy.record()

    def _upload_group(self, slot: DecodeSlot, g: int, k: int, masked: bool) -> None:
        if self.device.unified_memory:
            return
        upload = self.device.upload

        def h2d() -> None:
            slot.group_dev[g].copy_(slot.group_host[g], non_blocking=True)  # contiguous: plain DMAs
            slot.group_f_dev[g].copy_(slot.group_f_host[g], non_blocking=True)
            if masked:
                slot.mask_dev[g, :k].copy_(slot.mask_host[g, :k], non_blocking=True)

        upload.launch(h2d, "h2d")
        self.device.compute.wait(upload.record())

    # --- commit ---------------------------------------------------------------------------------

    async def read_sampled(self, slot: DecodeSlot) -> SampledTokens:
        """Await the step's copy event without blocking the loop, then read tokens and logprobs.
        Raises what launched work of the step (on any stream) raised."""
        await slot.copy_done.wait_async()
        return SampledTokens(*slot.read_host())

    # --- failure --------------------------------------------------------------------------------

    async def drain(self) -> None:
        """Wait until every stream has run what was launched on it (errors ignored: already handled)."""
        for stream in (self.device.compute, self.device.upload, self.device.copy):
            try:
                await stream.record().wait_async()
            except Exception:  # noqa: BLE001 - the failure being recovered from
                pass

    def recover(self, slots: list[DecodeSlot]) -> bool:
        """After drain: free the failed steps' slots and clear the device's sticky errors."""
        for slot in slots:
            slot.abandon()
        return self.device.recover()

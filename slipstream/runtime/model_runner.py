"""Runs steps on a device: forward on the compute stream, sampling after it, D2H on the copy stream.

The runner knows nothing about requests. It owns the model, the KV cache, the two DecodeSlots and
the carry-over table `token_table[row]`: sampling scatters each row's new token there, and the
next forward gathers decode inputs from it on the device, so a sampled token never has to visit
the host before it is fed back. Stream order (sampling of step t precedes the forward of t+1 on
the compute stream) is what makes that read correct.
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.models.attention import AttentionMetadata
from slipstream.models.llama import ForwardBatch, KVCache, LlamaForCausalLM
from slipstream.runtime.batch import PackedStep, SeqWork, SamplingRow
from slipstream.runtime.decode_slot import DecodeSlot
from slipstream.runtime.sampler import apply_bitmask, sample


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, device, max_rows: int, num_slots: int = 2,
                 row_multiple: int = 1):
        self.model, self.kv, self.device = model, kv, device
        self.row_multiple = row_multiple  # pad steps so CPU matmul rows do not depend on batch size
        self.token_table = torch.zeros(max_rows, dtype=torch.int64, device=device.torch_device)
        self.slots = [DecodeSlot(i, device, max_rows, model.config.vocab_size) for i in range(num_slots)]
        self.vocab_size = model.config.vocab_size

    # --- launch -------------------------------------------------------------------------------

    def launch_forward(self, slot: DecodeSlot, step_id: int, packed: PackedStep) -> None:
        """Enqueue the forward of one step into `slot`; returns at once."""
        slot.acquire(step_id)
        slot.num_samples = packed.num_samples
        dev = self.device.torch_device

        def forward() -> None:
            ids = torch.from_numpy(packed.input_ids).to(dev, non_blocking=True)
            if packed.from_device.any():
                from_dev = torch.from_numpy(packed.from_device).to(dev, non_blocking=True)
                rows = torch.from_numpy(packed.carry_rows).to(dev, non_blocking=True)
                ids = torch.where(from_dev, self.token_table[rows], ids)
            batch = ForwardBatch(
                input_ids=ids,
                positions=torch.from_numpy(packed.positions).to(dev, non_blocking=True),
                slot_mapping=torch.from_numpy(packed.slot_mapping).to(dev, non_blocking=True),
                sample_indices=torch.from_numpy(packed.sample_indices).to(dev, non_blocking=True),
                attn=AttentionMetadata(packed.query_start, packed.kv_lens, packed.page_tables, self.kv.page_size),
            )
            slot.logits = self.model(batch, self.kv)  # a non-final prefill chunk samples nothing but fills KV

        self.device.compute.launch(forward, "forward")
        slot.forward_done = self.device.compute.record()

    # --- sampling (at launch for rows that need nothing from the host, at finalize for the rest) ---

    def launch_sampling(self, slot: DecodeSlot, packed: PackedStep, works: list[SeqWork],
                        rows: list[int] | None = None, bitmask: np.ndarray | None = None,
                        final: bool = True) -> None:
        """Enqueue sampling of some of the step's sampling rows; with `final`, also the D2H copy.

        rows:    indices into the step's sampling rows (None: all of them). Each row is sampled
                 exactly once per step, so groups never overlap.
        bitmask: packed int32 [len(rows), ceil(V/32)] allowed-token masks for these rows, or
                 None. It is staged in the slot's host buffer, uploaded on the copy stream, and
                 sampling waits on that upload's event — not on anything else.
        final:   the last group of the step: the device→host copy of all its tokens follows,
                 anchored to an event recorded right after the last sampling.
        """
        n = packed.num_samples
        sampled_works = [w for w in works if w.sample]
        rows = list(range(n)) if rows is None else rows
        dev = self.device.torch_device
        compute, copy = self.device.compute, self.device.copy
        if rows:
            params = [sampled_works[i].sampling for i in rows]
            out_idx = [sampled_works[i].output_index for i in rows]
            want_logprobs = any(p.logprobs for p in params)
            idx_host = torch.tensor(rows, dtype=torch.long)
            carry_rows = torch.from_numpy(packed.sample_rows[rows])
            if bitmask is not None:
                slot.mask_host[idx_host] = torch.from_numpy(bitmask)

                def upload() -> None:
                    idx = idx_host.to(dev, non_blocking=True)
                    slot.mask_dev.index_copy_(0, idx, slot.mask_host[idx_host].to(dev, non_blocking=True))

                copy.launch(upload, "h2d")
                compute.wait(copy.record())

            def sample_rows() -> None:
                idx = idx_host.to(dev, non_blocking=True)
                logits = slot.logits.index_select(0, idx)
                if bitmask is not None:
                    logits = apply_bitmask(logits, slot.mask_dev.index_select(0, idx))
                ids = sample(logits, params, out_idx)
                slot.sampled.index_copy_(0, idx, ids)
                self.token_table[carry_rows.to(dev, non_blocking=True)] = ids
                if want_logprobs:  # of the model's own distribution, before masks and temperature
                    raw = slot.logits.index_select(0, idx).log_softmax(-1)
                    slot.logprobs.index_copy_(0, idx, raw.gather(1, ids[:, None])[:, 0])

            compute.launch(sample_rows, "sample")
        if not final:
            return
        slot.sample_done = compute.record()
        copy.wait(slot.sample_done)  # the copy waits for exactly this step's outputs

        def copy_out() -> None:
            if n:
                slot.host_sampled[:n].copy_(slot.sampled[:n], non_blocking=True)
                slot.host_logprobs[:n].copy_(slot.logprobs[:n], non_blocking=True)

        copy.launch(copy_out, "d2h")
        slot.copy_done = copy.record()

    # --- commit ---------------------------------------------------------------------------------

    async def read_sampled(self, slot: DecodeSlot) -> tuple[list[int], list[float]]:
        """Await the step's copy event without blocking the loop, then read tokens and logprobs."""
        await slot.copy_done.wait_async()
        return slot.read_host()

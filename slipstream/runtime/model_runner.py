"""Runs steps on a device: forward on the compute stream, sampling after it, D2H on the copy stream.

The runner knows nothing about requests. It owns the model, the KV cache, the two DecodeSlots and
the carry-over table `token_table[row]`: sampling scatters each row's new token there, and the
next forward gathers decode inputs from it on the device, so a sampled token never has to visit
the host before it is fed back. Stream order (sampling of step t precedes the forward of t+1 on
the compute stream) is what makes that read correct.
"""
from __future__ import annotations

import torch

from slipstream.models.attention import AttentionMetadata
from slipstream.models.llama import ForwardBatch, KVCache, LlamaForCausalLM
from slipstream.runtime.batch import PackedStep, SeqWork, SamplingRow
from slipstream.runtime.decode_slot import DecodeSlot
from slipstream.runtime.sampler import apply_token_mask, sample


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, device, max_rows: int, num_slots: int = 2,
                 row_multiple: int = 1):
        self.model, self.kv, self.device = model, kv, device
        self.row_multiple = row_multiple  # pad steps so CPU matmul rows do not depend on batch size
        self.token_table = torch.zeros(max_rows, dtype=torch.int64, device=device.torch_device)
        self.slots = [DecodeSlot(i, device, max_rows) for i in range(num_slots)]
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

    # --- finalize -------------------------------------------------------------------------------

    def launch_sampling(self, slot: DecodeSlot, packed: PackedStep, works: list[SeqWork],
                        allowed: torch.Tensor | None = None) -> None:
        """Enqueue sampling of the step in `slot` and the device→host copy of its tokens.

        `allowed` ([n, V] bool, host) restricts constrained rows; it is built after the previous
        commit, which is why sampling is enqueued separately from the forward.
        """
        n = packed.num_samples
        sampled_works = [w for w in works if w.sample]
        rows: list[SamplingRow] = [w.sampling for w in sampled_works]
        out_idx = [w.output_index for w in sampled_works]
        dev = self.device.torch_device

        def sample_step() -> None:
            if n == 0:
                return
            logits = slot.logits[:n]
            if allowed is not None:
                logits = apply_token_mask(logits, allowed.to(dev, non_blocking=True))
            ids = sample(logits, rows, out_idx)
            slot.sampled[:n] = ids
            self.token_table[torch.from_numpy(packed.sample_rows).to(dev)] = ids

        self.device.compute.launch(sample_step, "sample")
        slot.sample_done = self.device.compute.record()
        self.device.copy.wait(slot.sample_done)  # the copy waits for exactly this step's outputs

        def copy_out() -> None:
            if n:
                slot.host_sampled[:n].copy_(slot.sampled[:n], non_blocking=True)

        self.device.copy.launch(copy_out, "d2h")
        slot.copy_done = self.device.copy.record()

    # --- commit ---------------------------------------------------------------------------------

    async def read_sampled(self, slot: DecodeSlot) -> list[int]:
        """Await the step's copy event without blocking the loop, then read its tokens."""
        await slot.copy_done.wait_async()
        return slot.read_host()

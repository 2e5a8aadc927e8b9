"""A torch-free stand-in for ModelRunner, so the scheduler's invariants are tested without a device.

Its "model" is a pure function of the context tokens, read back from a fake paged KV store that is
written through the step's slot mapping — so a page released too early, reused while in flight,
or fed the wrong carry-over token changes the output and the test sees it.
Prompts are [marker, prompt_len, ...]: marker 1000 + k means "EOS as output token k".
"""
from __future__ import annotations

import asyncio

from slipstream.runtime.decode_slot import SlotState

EOS = 2
VOCAB = 300


def make_prompt(length: int, eos_at: int | None, salt: int) -> list[int]:
    body = [3 + (salt * 31 + i * 17) % (VOCAB - 3) for i in range(max(length - 2, 0))]
    return [1000 + eos_at if eos_at is not None else 3 + salt % 50, length] + body


def next_token(context: list[int]) -> int:
    first, prompt_len = context[0], context[1]
    if first >= 1000 and len(context) - prompt_len == first - 1000:
        return EOS
    return 3 + (sum(context) * 7 + len(context) * 13) % (VOCAB - 3)


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    ctx, out = list(prompt), []
    while len(out) < max_tokens:
        tok = next_token(ctx)
        out.append(tok)
        ctx.append(tok)
        if tok == EOS:
            break
    return out


class FakeSlot:
    def __init__(self, index: int):
        self.index, self.state, self.result, self.ready = index, SlotState.FREE, None, None

    @property
    def is_free(self) -> bool:
        return self.state is SlotState.FREE

    def release(self) -> None:
        assert self.state is SlotState.IN_FLIGHT
        self.state = SlotState.FREE


class FakeRunner:
    def __init__(self, page_size: int, yields: int = 2):
        self.page_size = page_size
        self.slots = [FakeSlot(0), FakeSlot(1)]
        self.kv: dict[int, int] = {}  # flat slot -> token
        self.table: dict[int, int] = {}  # carry-over row -> token
        self.yields = yields
        self.pending_logits = {}

    def launch_forward(self, slot, step_id, packed) -> None:
        assert slot.state is SlotState.FREE, "slot reused while in flight"
        slot.state = SlotState.IN_FLIGHT
        ids = [int(self.table[int(r)]) if d else int(t)
               for t, d, r in zip(packed.input_ids, packed.from_device, packed.carry_rows)]
        for i in range(packed.num_tokens):
            self.kv[int(packed.slot_mapping[i])] = ids[i]
        results = []
        for s in range(len(packed.kv_lens)):
            end = packed.query_start[s + 1]
            if end - 1 in set(packed.sample_indices[: packed.num_samples].tolist()):
                kv_len, pages = packed.kv_lens[s], packed.page_tables[s]
                ctx = [self.kv[pages[p // self.page_size] * self.page_size + p % self.page_size]
                       for p in range(kv_len)]
                results.append(ctx)
        slot.contexts = results

    def launch_sampling(self, slot, packed, works, rows=None, bitmask=None, final=True) -> None:
        out = []
        for ctx, row in zip(slot.contexts, packed.sample_rows.tolist()):
            tok = next_token(ctx)
            self.table[row] = tok
            out.append(tok)
        slot.result = out

    async def read_sampled(self, slot) -> list[int]:
        for _ in range(self.yields):  # let arrivals and aborts interleave with the commit
            await asyncio.sleep(0)
        return slot.result, [0.0] * len(slot.result)

"""Drafts from a smaller model with the same tokenizer ("draft": SpeculativeConfig(method="draft",
draft_model=...)): greedy tokens of the draft model after each row's newest tokens.

A simpler design than docs/speculative.md's (the draft model's KV pages in the engine's pool, kept
across steps and rolled back with the target's): each proposal recomputes. The drafter owns a small
KV cache of its own, `context + max_drafts` positions per row of the step; per step it feeds each
row's newest `context` tokens (`TokenHistory.window`) at positions 0.. as one prefill, then
`max_drafts - 1` one-token steps, each row taking the argmax. Nothing persists between steps, so
there is nothing to roll back when drafts are rejected, preemption and failed steps need nothing,
and any proposal is correct (verification decides what is emitted). The price: a prefill of
`context` tokens of the draft model per step, and the history read on the host (fine on the CPU; on
CUDA it would wait for the stream). The check that the two models share a vocabulary and tokenizer
is the API's (api/assemble.py: `speculative.draft_model`).
"""
from __future__ import annotations

from typing import Any

import torch

from slipstream.intmath import ceil_div
from slipstream.models.base import ForwardBatch, KVCache
from slipstream.models.kernels.attention import AttentionMetadata
from slipstream.speculation.drafter import Proposal
from slipstream.speculation.history import NO_TOKEN, TokenHistory

PAGE = 16


class DraftModelDrafter:
    reads_host = True  # (its proposal reads the history on the host: never in a captured graph)

    def __init__(self, history: TokenHistory, max_drafts: int = 4, model: Any = None, context: int = 64):
        if model is None:
            raise ValueError("the draft drafter needs a built draft model")
        self.history, self.max_drafts, self.model, self.context = history, max_drafts, model, context
        self.vocab = model.config.vocab_size
        self.row_pages = ceil_div(context + max_drafts, PAGE)
        self.kv: KVCache | None = None

    def on_chunks(self, token_rows, positions, tokens, chunk_rows, chunk_ends) -> None:
        self.history.write_chunks(token_rows, positions, tokens, chunk_rows, chunk_ends)

    def on_emitted(self, rows: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        self.history.append(rows, tokens, counts)

    def _cache(self, n: int) -> KVCache:
        """Room for n rows (page 0 is the padding's scratch page); grown, never shrunk."""
        if self.kv is None or self.kv.k.shape[1] < (1 + n * self.row_pages) * PAGE:
            self.kv = KVCache(self.model.config, 1 + n * self.row_pages, PAGE, torch.float32, torch.device("cpu"))
        return self.kv

    def _step(self, chunks: list[tuple[list[int], int]], kv: KVCache) -> torch.Tensor:
        """The argmax after each row's chunk (tokens, first position); row i owns pages 1 + i * row_pages..."""
        ids, pos, slots, starts, lens, samples, tables = [], [], [], [0], [], [], []
        for i, (tokens, start) in enumerate(chunks):
            pages = list(range(1 + i * self.row_pages, 1 + (i + 1) * self.row_pages))
            for j, token in enumerate(tokens):
                ids.append(token)
                pos.append(start + j)
                slots.append(pages[(start + j) // PAGE] * PAGE + (start + j) % PAGE)
            starts.append(len(ids))
            lens.append(start + len(tokens))
            samples.append(len(ids) - 1)
            tables.append(pages)
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        batch = ForwardBatch(t(ids), t(pos), t(slots), t(samples), AttentionMetadata(starts, lens, tables, PAGE))
        return self.model(batch, kv)[:, :self.vocab].argmax(-1)

    def propose(self, rows: torch.Tensor) -> Proposal:
        window = self.history.window(rows, self.context).cpu().tolist()
        n, k = len(window), self.max_drafts
        kv = self._cache(n)
        prompts = [[t for t in row if t != NO_TOKEN] or [0] for row in window]  # (a decode row has its last token)
        drafts = torch.empty(n, k, dtype=torch.int64)
        nxt = self._step([(p, 0) for p in prompts], kv)
        drafts[:, 0] = nxt
        for j in range(1, k):
            nxt = self._step([([int(nxt[i])], len(p) + j - 1) for i, p in enumerate(prompts)], kv)
            drafts[:, j] = nxt
        dev = rows.device
        return Proposal(drafts.to(dev), torch.ones(n, dtype=torch.bool, device=dev))

"""Prompt-lookup (n-gram) drafting on the device, for the whole group in one set of kernels.

A row's newest n tokens (n from `max_n` down to `min_n`) are looked up in its last `window` tokens
(prompt and output); the latest earlier occurrence of the longest n that has one gives the drafts:
the tokens that followed it. When the continuation runs into the present (repetition with period
p shorter than k), it is extended periodically: draft j is the token p places before it. No extra
model, no host work: the proposal is a few [n, window] comparisons and one gather.

In the window w (w[-1] the newest token) a continuation start c (c < len(w)) matches n tokens when
w[c - t] == w[-t] for t = 1..n; the period is p = len(w) - c, and draft j is w[c + j % p].
"""
from __future__ import annotations

import numpy as np
import torch

from slipstream.speculation.drafter import Proposal
from slipstream.speculation.history import NO_TOKEN, TokenHistory


class NgramDrafter:
    def __init__(self, history: TokenHistory, max_drafts: int = 4, min_n: int = 1, max_n: int = 3,
                 window: int = 1024):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n} max_n={max_n}")
        if window <= max_n:
            raise ValueError(f"window={window} must exceed max_n={max_n}")
        self.history, self.max_drafts = history, max_drafts
        self.min_n, self.max_n, self.window = min_n, max_n, window

    def on_chunks(self, token_rows, positions, tokens, chunk_rows, chunk_ends) -> None:
        self.history.write_chunks(token_rows, positions, tokens, chunk_rows, chunk_ends)

    def on_emitted(self, rows: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        self.history.append(rows, tokens, counts)

    def propose(self, rows: torch.Tensor) -> Proposal:
        # the same rule in numpy on the CPU: half the CPU time of torch's ops (tools/spec/bench_spec_cpu_paths.py)
        if rows.device.type == "cpu":
            return self._propose_numpy(rows)
        return self._propose_torch(rows)

    def _propose_numpy(self, rows: torch.Tensor) -> Proposal:
        width = self.window
        r = rows.numpy()
        tokens, length = self.history.tokens.numpy(), self.history.length.numpy()
        at = length[r][:, None] - width + np.arange(width)[None, :]
        w = np.where(at >= 0, tokens[r[:, None], np.maximum(at, 0)], NO_TOKEN).astype(np.int64)  # [n, W]
        drafts, matched, strength = self._match(w)
        return Proposal(torch.from_numpy(drafts), torch.from_numpy(matched), strength=torch.from_numpy(strength))

    def propose_tokens(self, tokens: list[int]) -> tuple[int, int]:
        """(the first draft, the matched length: 0 for none) after a row's newest tokens as the host
        has them: the device's rule on the host's copy, for the policy's shadow probes."""
        w = np.full((1, self.window), NO_TOKEN, np.int64)
        tail = tokens[-self.window:]
        if tail:
            w[0, self.window - len(tail):] = tail
        drafts, _, strength = self._match(w)
        return int(drafts[0, 0]), int(strength[0])

    def _match(self, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(drafts [n, K], matched [n], strength [n]) of windows w [n, W] (oldest first, NO_TOKEN before
        a row's first token)."""
        m, width = self.max_n, w.shape[1]
        padded = np.concatenate([np.full((len(w), m), NO_TOKEN, np.int64), w], axis=1)
        starts = np.arange(width)
        run = np.ones(w.shape, dtype=bool)
        best = np.full(len(w), -1, np.int64)
        strength = np.zeros(len(w), np.int64)
        for t in range(1, m + 1):
            run &= padded[:, m - t:m - t + width] == w[:, width - t:width - t + 1]
            if t >= self.min_n:
                latest = np.where(run, starts, -1).max(1)
                best = np.where(latest >= 0, latest, best)
                strength = np.where(latest >= 0, t, strength)
        matched = best >= 0
        period = np.maximum(width - best, 1)
        cols = np.maximum(best, 0)[:, None] + np.arange(self.max_drafts)[None, :] % period[:, None]
        drafts = np.take_along_axis(w, np.minimum(cols, width - 1), 1)
        filler = np.maximum(w[:, -1:], 0)
        return np.where(matched[:, None], drafts, filler), matched, strength

    def _propose_torch(self, rows: torch.Tensor) -> Proposal:
        m = self.max_n
        padded = self.history.window(rows, self.window + m)  # m more on the left: each shift is a view
        padded[:, :m] = NO_TOKEN  # (matches stay inside the window)
        w = padded[:, m:]  # [n, W]
        n, width = w.shape
        dev = w.device
        starts = torch.arange(width, device=dev)
        # run[:, c]: the n-gram before c equals the newest n tokens, for n = 1, 2, ... (cumulative AND;
        # padding never matches: that would need c >= W)
        run = torch.ones(n, width, dtype=torch.bool, device=dev)
        best = torch.full((n,), -1, dtype=torch.int64, device=dev)
        length = torch.zeros(n, dtype=torch.int64, device=dev)
        for t in range(1, m + 1):
            run &= padded[:, m - t:m - t + width] == w[:, width - t:width - t + 1]  # w[:, c - t] == w[:, -t]
            if t >= self.min_n:  # the latest start matching t tokens; a longer n overrides a shorter one
                latest = torch.where(run, starts, -1).amax(1)
                best = torch.where(latest >= 0, latest, best)
                length = torch.where(latest >= 0, t, length)
        matched = best >= 0
        period = (width - best).clamp(min=1)
        cols = best.clamp(min=0)[:, None] + torch.arange(self.max_drafts, device=dev)[None, :] % period[:, None]
        drafts = w.gather(1, cols.clamp(max=width - 1))
        filler = w[:, -1:].clamp(min=0).expand_as(drafts)  # any id is a correct draft; this one is cheap
        return Proposal(torch.where(matched[:, None], drafts, filler), matched, strength=length)

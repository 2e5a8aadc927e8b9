"""Token sampling on the device: greedy, temperature, top-k, top-p, per-request seeds, masks.

Random rows use the exponential-race form of categorical sampling (argmax of p / E with
E ~ Exp(1)); each row draws its noise from a generator seeded by (request seed, output index),
so a seeded request samples the same tokens whatever batch it lands in.
"""
from __future__ import annotations

import torch

from slipstream.grammar.bitmask import bitmask_to_bool
from slipstream.runtime.batch import SamplingRow

_SEED_STRIDE = 1_000_003


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed logits (packed int32 masks, slipstream/grammar/bitmask.py) become -inf."""
    return logits.masked_fill(~bitmask_to_bool(bitmask, logits.shape[-1]), float("-inf"))


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, rows: list[SamplingRow], output_indices: list[int]) -> torch.Tensor:
    """logits [n, V] float32 -> token ids [n] int64."""
    out = logits.argmax(dim=-1)
    for i, row in enumerate(rows):
        if row.temperature <= 0.0:
            continue
        x = _filter_top_k_top_p(logits[i] / row.temperature, row.top_k, row.top_p)
        gen = torch.Generator(device=logits.device)
        gen.manual_seed((row.seed * _SEED_STRIDE + output_indices[i]) & 0x7FFF_FFFF_FFFF_FFFF)
        u = torch.rand(x.shape, generator=gen, device=logits.device).clamp_(min=1e-20)
        out[i] = (x.softmax(-1) / -u.log()).argmax()
    return out

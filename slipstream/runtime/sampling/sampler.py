"""Token sampling on the device, one set of kernels for the whole batch: greedy, temperature,
top-k, top-p, per-request seeds, grammar masks.

Every per-row parameter is a tensor (a group's `SamplingArgs`, runtime/sampling/sampling_args.py: [n]
temperature, top_k, top_p, seed, output index, ...), so the batch is sampled without a Python loop
over rows; a field left None skips its kernel. Random rows use the Gumbel-max form of
categorical sampling: argmax(logits / T + g) with g = -log(-log u). The uniforms u come from a
counter-based generator: a 32-bit integer hash of (seed, output index, token id). A row's noise
depends only on its own request's seed and position, never on which other rows share the batch,
the pipeline depth, or the step, so a seeded request samples the same tokens alone, in any batch,
at depth 1 and 2. (Integer ops on int64 with every product below 2**63: no reliance on overflow.)
"""
from __future__ import annotations

import torch

from slipstream.grammar.bitmask import bitmask_to_bool
from slipstream.runtime.sampling.logits_process import apply_penalties, min_p_filter, suppress_stop_tokens
from slipstream.runtime.sampling.sampling_args import Draw, SamplingArgs

_M32 = 0xFFFFFFFF
_MUL1, _MUL2 = 0x7FEB352D, 0x1B873593  # odd, < 2**31: x * m < 2**63 for x < 2**32
_ROW_SALT, _COL_SALT = 0x2545F491, 0x68E31DA5


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed logits (packed int32 masks, slipstream/grammar/bitmask.py) become -inf."""
    return logits.masked_fill(~bitmask_to_bool(bitmask, logits.shape[-1]), float("-inf"))


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit mixing hash (two multiply-xorshift rounds) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """[n] int64 keys in [0, 2**32) from 63-bit seeds and output positions."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = hash32(lo ^ hash32(hi))
    return hash32(key ^ ((output_index * _ROW_SALT) & _M32))


def uniforms(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, vocab] float32 uniforms in (0, 1), a pure function of (key, token id). 23 bits: every
    (k + 0.5) / 2**23 is exact in float32, so none rounds to 1.0, whose noise would be +inf (a
    masked token's logit -inf + inf = NaN, which argmax picks; 24 bits did that once in 2**24)."""
    cols = (torch.arange(vocab, device=keys.device, dtype=torch.int64) * _COL_SALT) & _M32
    h = hash32(keys[:, None] ^ cols[None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Rows of x (scaled logits) with everything outside each row's top-k / top-p set to -inf.
    top_k <= 0 and top_p >= 1 disable a filter for that row."""
    vocab = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=x.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = ranks[None, :] >= k[:, None]
    probs = sorted_x.masked_fill(drop, float("-inf")).softmax(-1)
    # keep the smallest prefix whose mass reaches top_p (always at least the top token)
    drop |= (probs.cumsum(-1) - probs) >= top_p[:, None]
    return x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))


def draw_logits(logits: torch.Tensor, draw: Draw) -> torch.Tensor:
    """What a draw samples from: random rows' logits [n, V] at their temperature with top-k / top-p
    applied (softmax of a row is its distribution); greedy rows' logits come back unscaled.
    Speculative verification (speculation/verify.py) reads the same distribution."""
    temperature = draw.temperature
    x = logits / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    if draw.filter is not None:
        x = _filter_top_k_top_p(x, *draw.filter)
    return x


def sample(logits: torch.Tensor, args: SamplingArgs) -> torch.Tensor:
    """logits [n, V] float32 -> token ids [n] int64. Rows with temperature 0 are greedy."""
    greedy = logits.argmax(dim=-1)
    if args.draw is None:
        return greedy
    x = draw_logits(logits, args.draw)
    u = uniforms(row_keys(args.draw.seed, args.output_index), logits.shape[-1])
    drawn = (x - (-u.log()).log()).argmax(dim=-1)
    return torch.where(args.draw.temperature > 0, drawn, greedy)


def process_group(logits: torch.Tensor, args: SamplingArgs,
                  history: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """One sampling group's logits [n, V] after penalties → grammar mask → min_tokens → min_p, each only
    where `args` says a row needs it. `history`: the rows' (output counts, prompt mask, stop mask) when
    args.needs_history; `bitmask`: packed allowed tokens."""
    if args.penalties is not None:
        assert history is not None
        logits = apply_penalties(logits, history[0], history[1], *args.penalties)
    if bitmask is not None:
        logits = apply_bitmask(logits, bitmask)
    if args.min_tokens is not None:
        assert history is not None
        logits = suppress_stop_tokens(logits, history[2], args.output_index, args.min_tokens)
    if args.min_p is not None:
        assert args.draw is not None  # min_p is only set for random rows
        logits = min_p_filter(logits, args.draw.temperature, args.min_p)
    return logits


def sample_group(logits: torch.Tensor, args: SamplingArgs,
                 history: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """One sampling group's logits [n, V] -> ids [n]: `process_group`, then `sample`."""
    return sample(process_group(logits, args, history, bitmask), args)

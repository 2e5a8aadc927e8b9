"""Logit processing on the device for the whole batch: penalties, min_p, min_tokens, top-k logprobs.

Like slipstream/runtime/sampling/sampler.py, every per-row parameter is a tensor ([n] floats or ints) and
no function loops over rows, so one set of kernels serves any mix of requests. The state these
need lives in per-row tables the runner can keep on the device for the life of a row
([max_rows, V]), indexed with the step's row ids:

    output_counts [R, V] int32   how often each token was sampled in the row's output so far
    prompt_mask   [R, V] bool    which tokens occur in the row's prompt
    stop_mask     [R, V] bool    the row's EOS / stop_token_ids (what min_tokens holds back)

`HistoryTables` (slipstream/runtime/step/row_tables.py) holds them. `reset_rows` fills a row's tables at
admission (and rebuilds them after a preemption, from the prompt and the output so far);
`record_sampled` adds a step's sampled tokens to the counts, after sampling, on the same stream.
Every function is exact at the neutral value of its parameter: a row with presence = frequency = 0,
repetition = 1, min_p = 0 and min_tokens = 0 comes out bit-identical, so greedy rows without
penalties pick the same tokens as before.

Order within a step: raw logits → (top-k logprobs and the sampled token's logprob read the raw
logits) → penalties → grammar bitmask → min_tokens → min_p → sampler (temperature, top-k, top-p,
draw). As in vLLM, penalties come before the temperature and min_p before top-k / top-p.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class ProcessFlags:
    """What the host knows about a sampling group at launch: which steps any of its rows needs.
    A group with none of them launches nothing here (and stays bit-identical)."""

    penalties: bool  # some row has presence / frequency != 0 or repetition != 1
    min_tokens: bool  # some row samples a token before its min_tokens
    min_p: bool  # some sampled row (temperature > 0) has min_p > 0
    top_logprobs: int  # the largest top_logprobs in the group (0: none)

    @property
    def any_logits_change(self) -> bool:
        return self.penalties or self.min_tokens or self.min_p


def process_flags(params: Iterable, output_index: Iterable[int]) -> ProcessFlags:
    """From the group's per-row parameters (anything with SamplingParams' field names, e.g.
    SamplingParams itself) and the output index of the token each row samples."""
    params, output_index = list(params), list(output_index)
    return ProcessFlags(
        penalties=any(p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1 for p in params),
        min_tokens=any(i < p.min_tokens for p, i in zip(params, output_index)),
        min_p=any(p.temperature > 0 and p.min_p > 0 for p in params),
        top_logprobs=max((p.top_logprobs for p in params), default=0))


def apply_penalties(logits: torch.Tensor, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """Penalised copy of logits [n, V] (float).

    output_counts [n, V] (int): occurrences of each token in the row's output so far.
    prompt_mask   [n, V] (bool): tokens present in the row's prompt.
    presence, frequency [n] (float, in [-2, 2]): logit -= presence * (count > 0) + frequency * count.
    repetition    [n] (float, > 0): a token seen in the prompt or the output has a positive logit
                  divided by it, a negative one multiplied by it (1: off).
    """
    counts = output_counts.to(logits.dtype)
    seen = prompt_mask | (output_counts > 0)
    rep = torch.where(seen, repetition[:, None].to(logits.dtype), torch.ones((), dtype=logits.dtype,
                                                                             device=logits.device))
    x = torch.where(logits > 0, logits / rep, logits * rep)  # x / 1 and x * 1 are exact
    x = x - frequency[:, None].to(logits.dtype) * counts  # 0 * count is 0: exact for neutral rows
    return x - presence[:, None].to(logits.dtype) * (output_counts > 0).to(logits.dtype)


def suppress_stop_tokens(logits: torch.Tensor, stop_mask: torch.Tensor, output_index: torch.Tensor,
                         min_tokens: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with each row's stop tokens (stop_mask [n, V] bool) at -inf while the token being
    sampled is one of its first min_tokens [n] (output_index [n]: 0 for the first output token).

    A row whose only allowed tokens are stop tokens (a grammar that can only end) keeps them: an
    all -inf row would sample an arbitrary token. So apply it after the grammar bitmask."""
    drop = stop_mask & (output_index < min_tokens)[:, None]
    left = ((logits > NEG_INF) & ~drop).any(dim=-1, keepdim=True)
    return logits.masked_fill(drop & left, NEG_INF)


def min_p_filter(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [n, V] with the tokens whose probability at the row's temperature is below
    min_p [n] times the most likely token's set to -inf. Kept tokens keep their logits (the sampler
    applies the temperature itself). Greedy rows (temperature 0) and min_p 0 are left as they are;
    the most likely token is always kept."""
    active = (temperature > 0) & (min_p > 0)
    t = torch.where(active, temperature, torch.ones_like(temperature)).to(logits.dtype)
    probs = (logits / t[:, None]).softmax(dim=-1)
    threshold = torch.where(active, min_p.to(logits.dtype), torch.zeros_like(t)) * probs.amax(dim=-1)
    return logits.masked_fill(probs < threshold[:, None], NEG_INF)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row of raw logits [n, V] under the model's own distribution
    (log_softmax, before penalties, masks and temperature: the same distribution as the sampled
    token's logprob). Returns (logprobs [n, k] float32, token ids [n, k] int64), most likely first.
    k is the largest any row of the group asked for; the host keeps each row's own first k_i."""
    values, ids = logits.float().log_softmax(dim=-1).topk(k, dim=-1)
    return values, ids


def record_sampled(output_counts: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
    """After sampling: output_counts[rows[i], tokens[i]] += 1 (in place; rows [n], tokens [n] int64)."""
    ones = torch.ones(rows.shape, dtype=output_counts.dtype, device=output_counts.device)
    output_counts.index_put_((rows, tokens), ones, accumulate=True)


def reset_rows(output_counts: torch.Tensor, prompt_mask: torch.Tensor, stop_mask: torch.Tensor, rows: torch.Tensor,
               prompt_ids: torch.Tensor, prompt_rows: torch.Tensor, output_ids: torch.Tensor,
               output_rows: torch.Tensor, stop_ids: torch.Tensor, stop_rows: torch.Tensor) -> None:
    """A row's tables from scratch (admission, or re-admission after a preemption), for several rows at once.

    rows [m]: the table rows to clear. The tokens come flattened with the row each belongs to:
    prompt_ids / prompt_rows [P], output_ids / output_rows [O] (the output so far: empty at admission),
    stop_ids / stop_rows [S] (EOS unless ignore_eos, and stop_token_ids)."""
    output_counts.index_fill_(0, rows, 0)
    prompt_mask.index_fill_(0, rows, False)
    stop_mask.index_fill_(0, rows, False)
    prompt_mask.index_put_((prompt_rows, prompt_ids), torch.ones_like(prompt_ids, dtype=torch.bool))
    stop_mask.index_put_((stop_rows, stop_ids), torch.ones_like(stop_ids, dtype=torch.bool))
    record_sampled(output_counts, output_rows, output_ids)


def flat_rows(rows: list[int], token_lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Host helper for reset_rows: ([ids...], [row of each id...]) as int64 arrays (the caller
    uploads them without a blocking copy: HistoryTables.admit)."""
    ids = np.fromiter((t for tokens in token_lists for t in tokens), np.int64)
    owner = np.repeat(np.asarray(rows, np.int64), [len(tokens) for tokens in token_lists])
    return ids, owner


def process_logits(logits: torch.Tensor, flags: ProcessFlags, output_counts: torch.Tensor, prompt_mask: torch.Tensor,
                   stop_mask: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor,
                   output_index: torch.Tensor, min_tokens: torch.Tensor, temperature: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """Penalties, min_tokens and min_p in that order, each only when `flags` says a row needs it.
    logits [n, V] already carry the grammar mask; the tables are the group's rows ([n, V], e.g.
    `table.index_select(0, rows)`); the result goes to sampler.sample."""
    if flags.penalties:
        logits = apply_penalties(logits, output_counts, prompt_mask, presence, frequency, repetition)
    if flags.min_tokens:
        logits = suppress_stop_tokens(logits, stop_mask, output_index, min_tokens)
    if flags.min_p:
        logits = min_p_filter(logits, temperature, min_p)
    return logits

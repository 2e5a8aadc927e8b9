"""Splitting the step's token budget among prompt chunks (running prompts and new admissions).

Rules, enforced here:
  * Water-filling: a short prompt gets all it needs, long prompts split what is left, so a long
    prompt never holds the whole budget while a short request waits behind it.
  * No sample is scheduled beyond max_tokens: a chunk that would end at the newest known token of
    a sequence with no samples left is not planned.
  * A bidirectional prefix (Moondream's BOS + image, `Sequence.bidirectional_len`) is never split:
    while it is not scheduled, the sequence's chunk reaches its end or the sequence waits a step.
    Such sequences take their prefix from the budget first (in order), the rest is water-filled.
"""
from __future__ import annotations

from slipstream.runtime.batch import SeqWork, image_slices
from slipstream.scheduler.sequence import Sequence


def fair_shares(needs: list[int], budget: int) -> list[int]:
    """Split `budget` over `needs` by water-filling: the highest level L with sum(min(need, L)) <=
    budget, so small needs are met in full and large ones split the rest evenly; the rounding
    remainder (fewer tokens than unmet needs) goes one each to the earliest."""
    lo, hi = 0, max(needs, default=0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in needs) <= budget:
            lo = mid
        else:
            hi = mid - 1
    shares = [min(n, lo) for n in needs]
    left = budget - sum(shares)
    for i, need in enumerate(needs):
        if left <= 0:
            break
        if shares[i] < need:
            shares[i] += 1
            left -= 1
    return shares


def prompt_shares(seqs: list[Sequence], budget: int) -> list[int]:
    """fair_shares of `budget`, where a sequence with an unscheduled bidirectional prefix gets at
    least its `min_chunk` (taken first, in order, while the budget holds it) or nothing this step."""
    mins, left = [], budget
    for seq in seqs:
        need = seq.min_chunk
        fits = need <= left
        mins.append(need if fits else -1)  # -1: its prefix does not fit what is left of this step
        left -= need if fits else 0
    rest = fair_shares([0 if m < 0 else seq.num_unscheduled - m for seq, m in zip(seqs, mins)], left)
    return [0 if m < 0 else m + extra for m, extra in zip(mins, rest)]


def next_chunk(seq: Sequence, budget: int) -> SeqWork | None:
    """The next chunk of at most `budget` host-known tokens, or None if it would sample past max_tokens."""
    n = min(seq.num_unscheduled, budget)
    reaches_end = n == seq.num_unscheduled
    if reaches_end and seq.samples_left <= 0:
        return None
    return chunk_work(seq, n, sample=reaches_end)


def chunk_work(seq: Sequence, n: int, sample: bool) -> SeqWork:
    """The runner's description of a chunk (the one place the scheduler builds a SeqWork)."""
    start = seq.num_scheduled
    assert seq.row is not None, f"{seq.request_id}: a chunk for a sequence without a row"
    # the first chunk after admission (at a prefix-cache hit's end, else 0) rebuilds the row's history
    history = ((seq.prompt_ids, list(seq.output_ids))
               if start == seq.prefix.num_reused and seq.sampling.needs_history else None)
    # a recompute of carried outputs re-feeds their values, which the host kept (Sequence.carried)
    carry = seq.carried_inputs(start, start + n) if seq.carried else ()
    return SeqWork(row=seq.row, tokens=seq.known_tokens(start, start + n), start_pos=start, sample=sample,
                   output_index=len(seq.output_ids) + seq.pending_samples, sampling=seq.sampling,
                   history=history, images=image_slices(seq.images.spans, start, start + n) if seq.images is not None else [],
                   carry=carry,
                   bidirectional_len=seq.bidirectional_len if start < seq.bidirectional_len else 0)

"""Which sampling rows need a grammar mask, and building those masks from committed state.

Forward now, sample later: a row whose matcher's mask depends on the previous token can only be
sampled after that token has been committed, so it is sampled in finalize; every other row —
unconstrained, or constrained by a mask that does not depend on the previous token — is sampled
right behind the forward at launch and never waits for the host. So is a row whose matcher's mask
is a function of the output index only (`mask_by_output_index`, grammar/base.py): its mask is built
at launch for the row's upcoming output index, when the tick ends its request at the grammar's
completion (`Sequence.ends_with_grammar`). Zombie rows (finished after their step was planned) are
never constrained: they get an all-ones row.
"""
from __future__ import annotations

import time
from typing import Callable, cast

import numpy as np

from slipstream.grammar.base import IndexMaskMatcher, masks_by_output_index
from slipstream.grammar.bitmask import words_for
from slipstream.scheduler.sequence import Sequence

ALL_ALLOWED = -1  # int32 with every bit set


class Constraints:
    def __init__(self, vocab_width: int, eos_ids: tuple[int, ...], fail: Callable[[Sequence, BaseException], None]):
        self.words = words_for(vocab_width)
        self.vocab_width = vocab_width
        self.eos_ids = eos_ids
        self._fail = fail  # fails one request with an error; the batch goes on
        self.mask_build_s = 0.0  # host time spent building masks (benchmarks)
        self.faults = None  # tests only: a slipstream.faults.FaultInjector
        self.live = 0  # submitted, unfinished sequences with a grammar: 0 means no step needs a mask

    def on_submit(self, seq: Sequence) -> None:
        if seq.matcher is not None:
            self.live += 1

    def on_finish(self, seq: Sequence, reason: str) -> None:
        if seq.matcher is not None:
            self.live -= 1

    def split(self, sampling_seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """(early, late) indices of a step's sampling rows (`sampling_seqs` in sampling-row order)."""
        early: list[int] = []
        late: list[int] = []
        for i, seq in enumerate(sampling_seqs):
            m = seq.matcher
            (late if m is not None and m.depends_on_previous_token and not _by_index(seq) else early).append(i)
        return early, late

    def masks(self, sampling_seqs: list[Sequence], rows: list[int]) -> np.ndarray | None:
        """Packed masks for `rows` from each matcher's committed state; None if none is constrained."""
        if not any(sampling_seqs[i].matcher is not None for i in rows):
            return None
        t0 = time.perf_counter()
        out = np.full((len(rows), self.words), ALL_ALLOWED, dtype=np.int32)
        for k, i in enumerate(rows):
            seq = sampling_seqs[i]
            m = seq.matcher
            if m is None or seq.finished:
                continue
            out[k] = 0
            try:
                if self.faults is not None:
                    self.faults.check("matcher", seq.request_id)
                if m.is_terminated():
                    words = out[k].view(np.uint32)
                    for e in self.eos_ids:  # a finished grammar may only end the output
                        words[e >> 5] |= np.uint32(1 << (e & 31))
                elif _by_index(seq):  # called after the step's launch: its own sample is pending
                    index = len(seq.output_ids) + seq.pending_samples - 1
                    cast(IndexMaskMatcher, m).mask_for_output_index(index, out[k])
                else:
                    m.fill_bitmask(out[k])
            except Exception as e:  # noqa: BLE001 - a plugin may raise anything; only its request fails
                from slipstream.errors import GrammarError

                out[k] = ALL_ALLOWED
                self._fail(seq, e if isinstance(e, GrammarError) else GrammarError(f"grammar matcher failed: {e!r}"))
        self.mask_build_s += time.perf_counter() - t0
        return out


def _by_index(seq: Sequence) -> bool:
    """Its mask is built from its upcoming output index, not from the matcher's committed state."""
    return seq.ends_with_grammar and masks_by_output_index(seq.matcher)

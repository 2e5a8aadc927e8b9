"""The encoder budget of a step: how many image-encoder output rows a step may compute.

Rules, enforced here:
  * A chunk that reaches an image whose encoder output is not held (`EncoderCache.needs_encode`)
    plans that image's encode in the same step (launched before the forward); an image already
    encoded, or planned by an earlier chunk of the step, costs nothing.
  * The encodes of a step total at most `budget` rows, except that the first image of a step is
    always allowed (an image larger than the budget still runs, alone). A chunk whose next image
    does not fit ends before that image's first placeholder: the prompt resumes there next step,
    and the rest of the token budget goes to decode rows and other prompts.
"""
from __future__ import annotations

from slipstream.runtime.batch import ImageSpan
from slipstream.scheduler.encoder_cache import EncoderCache
from slipstream.scheduler.sequence import Sequence


class EncoderBudget:
    """One step's encodes, planned chunk by chunk."""

    def __init__(self, cache: EncoderCache, budget: int):
        self.cache, self.left = cache, budget
        self.encodes: list[ImageSpan] = []
        self._planned: set[bytes] = set()

    def cut(self, seq: Sequence, n: int) -> tuple[int, list[ImageSpan]]:
        """How many of the `n` tokens from its next unscheduled one the step can feed, and the images
        whose encodes that needs (planned only by `take`, once the chunk is certain)."""
        start = seq.num_scheduled
        end, left = start + n, self.left
        need: list[ImageSpan] = []
        assert seq.images is not None  # (the Planner cuts only sequences with images)
        for span in seq.images.spans:
            if span.start >= end:
                break
            if span.end <= start or span.digest in self._planned or not self.cache.needs_encode(span.digest):
                continue
            if any(s.digest == span.digest for s in need):
                continue
            if span.num_features > left and (self.encodes or need):
                end = max(span.start, start)
                break
            need.append(span)
            left -= span.num_features
        return end - start, need

    def take(self, spans: list[ImageSpan]) -> None:
        for span in spans:
            self.cache.launched(span.digest)
            self._planned.add(span.digest)
            self.encodes.append(span)
            self.left -= span.num_features

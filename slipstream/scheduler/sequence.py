"""Per-sequence state shared by the planner and the pipeline.

Token accounting (host side; the newest sampled tokens may still be on the device):
  known       = prompt_ids + output_ids            tokens the host has
  num_scheduled                                    tokens whose forward has been launched
  num_computed                                     tokens whose K/V a committed step wrote (or a
                                                   prefix-cache hit mapped): <= num_scheduled
  pending_samples                                  launched steps that will sample a token for it
While decoding, the input of the next step is the last sampled token, which lives on the device
until its step commits. A sequence with carry tokens (`SamplingRow.carry`) keeps the head values
its committed carry tokens carried (`carried`, by output index): the known input at position
len(prompt_ids) + i is then that value, not the token, so a recompute re-feeds it
(chunking.chunk_work) and its pages hash it (prefix_cache.py). (checked by `check`):
  num_scheduled <= len(known) + max(pending_samples - 1, 0)   and   pending_samples <= inflight_refs
  + drafts_in_flight (a speculating step counts its k drafts as samples until its commit).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from slipstream.errors import PipelineInvariantError
from slipstream.runtime.batch import ImageSpan, SamplingRow

if TYPE_CHECKING:
    from slipstream.grammar.base import Matcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted and waiting to be recomputed
    RUNNING = "running"
    RELEASED = "released"  # finished (or aborted while waiting), its pages and row returned


@dataclass(eq=False)
class PrefixState:
    """A sequence's state in the prefix cache (scheduler/prefix_cache.py): read at admission, when a
    commit completes a page, and at preemption; never by a plain decode step."""

    cache_extra: bytes | None = b""  # extra key of its block hashes (the cache salt); None: no caching
    num_reused: int = 0  # known tokens mapped from the cache at its last admission (its first chunk starts there)
    # prompt tokens its first admission mapped from the cache (usage.cached_tokens): a recompute after a
    # preemption hits pages it registered itself, which are no gift of the cache to the request
    num_cached_tokens: int = 0
    num_registered_pages: int = 0  # leading pages of `pages` the cache maps (registered or hit)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of its known full pages so far


@dataclass(eq=False)
class ImageState:
    """The images of a sequence's prompt (scheduler/encoder_cache.py, encoder_budget.py): read when
    it is admitted, chunked or released, never by a decode step."""

    spans: list[ImageSpan]  # in position order
    held: tuple[bytes, ...] = ()  # the digests it holds encoder-cache references to (those its chunks feed)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingRow
    status: SeqStatus = SeqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    # pipeline state
    finished: bool = False  # hit EOS / stop / length / abort; its result has been emitted
    finish_reason: str | None = None
    inflight_refs: int = 0  # launched steps referencing this sequence not yet committed (0..depth)
    num_scheduled: int = 0
    pending_samples: int = 0
    preempting: bool = False  # chosen as a preemption victim; recomputed once inflight_refs hits 0
    num_preemptions: int = 0
    row: int | None = None  # its row of the runner's device tables while admitted
    last_token_on_device: bool = False  # its row holds its newest sampled token (set once a sample launches)
    pages: list[int] = field(default_factory=list)
    # its leading pages given back because they lie wholly before every layer's sliding window: their
    # entries in `pages` are 0 (the scratch page), their places in the row's table left as they were
    pages_released: int = 0
    # output index -> (carry kind, head values) of each committed carry token (the carried values)
    carried: dict[int, tuple[int, tuple[float, ...]]] = field(default_factory=dict)
    num_computed: int = 0  # (read at every commit: flat; the prefix cache's own state is `prefix`)
    prefix: PrefixState = field(default_factory=lambda: PrefixState())
    images: ImageState | None = None  # the images of its prompt (None: a text prompt)
    # its first positions attend both ways (Moondream's BOS + image): computed in one chunk (chunking.py)
    bidirectional_len: int = 0
    user: Any = None  # the request object of the API layer (opaque to the scheduler)
    # its grammar's matcher, set by the API layer at submit (the output stage advances it); the
    # scheduler builds grammar masks from it
    matcher: Matcher | None = None
    # the tick ends it at the token that completes its grammar (no stop strings): what lets a matcher
    # with `mask_by_output_index` be sampled at launch (constraints.py)
    ends_with_grammar: bool = False
    # speculative decoding (speculation/policy.py): drafts its steps in flight feed (counted in
    # pending_samples and num_scheduled as if all were accepted), and its acceptance so far
    drafts_in_flight: int = 0
    drafts_accepted: float = 0.0  # decayed counts of accepted drafts and of drafts that decided a step
    drafts_tried: float = 0.0
    steps_without_drafts: int = 0  # plans since it last drafted (the adaptive policy probes again)
    shadow_at: int = 0  # the plain commit its next shadow probe is due at (speculation/policy.py); 0: none
    speculate: bool = True  # SamplingParams.speculative: False, never in a step with drafts
    # decayed counts of its committed steps planned with drafts, and of those where the device fed any
    # (on the CPU the device feeds none for a weak n-gram match: speculation/runner.py)
    draft_plans: float = 0.0
    draft_feeds: float = 0.0

    @property
    def min_chunk(self) -> int:
        """The fewest tokens its next chunk may hold: up to its bidirectional prefix's end while that
        is not scheduled yet (a chunk may start inside it after a prefix-cache hit), else 0."""
        return max(self.bidirectional_len - self.num_scheduled, 0)

    @property
    def num_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def known_tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    def carried_inputs(self, start: int, end: int) -> tuple[tuple[int, int, tuple[float, ...]], ...]:
        """Known inputs in positions [start, end) that are carried values: (position - start, kind, values)."""
        p = len(self.prompt_ids)
        return tuple((p + i - start, kind, values) for i, (kind, values) in sorted(self.carried.items())
                     if start <= p + i < end)

    @property
    def num_unscheduled(self) -> int:
        """Host-known tokens whose forward is not launched yet: the rest of a prompt, or a recompute."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_scheduled

    @property
    def samples_left(self) -> int:
        """Tokens still allowed by max_tokens beyond those committed or already being sampled."""
        return self.max_tokens - len(self.output_ids) - self.pending_samples

    @property
    def decodes_on_device(self) -> bool:
        """Its next input is its newest sampled token, which its row holds on the device: every known
        token is scheduled and the one token not yet known is the last sample launched."""
        return self.last_token_on_device and self.num_scheduled == (
            len(self.prompt_ids) + len(self.output_ids) + self.pending_samples - 1)

    @property
    def preemptible(self) -> bool:
        return not self.finished and not self.preempting and self.row is not None

    def pages_needed(self, end_pos: int, page_size: int) -> int:
        """Pages it lacks to hold positions up to `end_pos` (0 or less: it has them)."""
        return -(-end_pos // page_size) - len(self.pages)

    def check(self) -> None:
        if not 0 <= self.pending_samples - self.drafts_in_flight <= self.inflight_refs:
            raise PipelineInvariantError(f"{self.request_id}: pending_samples={self.pending_samples} "
                                         f"inflight_refs={self.inflight_refs}")
        if not self.num_computed <= self.num_scheduled:
            raise PipelineInvariantError(f"{self.request_id}: computed {self.num_computed} tokens but only "
                                         f"{self.num_scheduled} scheduled")
        if self.num_scheduled > self.num_known + max(self.pending_samples - 1, 0):
            raise PipelineInvariantError(f"{self.request_id}: scheduled {self.num_scheduled} tokens but only "
                                         f"{self.num_known} known + {self.pending_samples} pending")

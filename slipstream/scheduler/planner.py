"""Plan: choose the next step's batch from sequences and page counts (pure Python).

A step is planned in four parts, each in its own module with the rules it enforces:
  decode_rows.py       which running sequences decode this step (one device-fed token each)
  admission.py         the waiting queue and the rows; admitting reserves a whole prompt's pages
  chunking.py          the rest of the token budget split among prompt chunks (water-filling)
  page_reservation.py  pages handed to sequences, and the page-table entries the step carries
  preemption.py        making room for a page by preempting, and releasing pages and rows
  prefix_cache.py      full pages of committed K/V by block hash, mapped at admission (None: off)
  encoder_cache.py     images' encoder outputs by digest, held by admitted sequences
  encoder_budget.py    the image encodes a step may plan (a chunk ends before an image that does not fit)
"""
from __future__ import annotations

from collections import deque

from slipstream.runtime.batch import SeqWork
from slipstream.scheduler.admission import Admission
from slipstream.scheduler.chunking import next_chunk, prompt_shares
from slipstream.scheduler.decode_rows import choose_decode_rows
from slipstream.scheduler.encoder_budget import EncoderBudget
from slipstream.scheduler.encoder_cache import EncoderCache
from slipstream.scheduler.page_pool import PagePool
from slipstream.scheduler.page_reservation import PageReservation
from slipstream.scheduler.preemption import Preemption
from slipstream.scheduler.prefix_cache import PrefixCache
from slipstream.scheduler.sequence import Sequence
from slipstream.scheduler.step import Step


class Planner:
    def __init__(self, pool: PagePool, page_size: int, max_batch_size: int, max_step_tokens: int,
                 prefix_caching: bool = False, encoder_cache_tokens: int = 0, max_encoder_tokens: int = 0):
        self.pool, self.page_size = pool, page_size
        self.max_batch_size, self.max_step_tokens = max_batch_size, max_step_tokens
        self.pages = PageReservation(pool, page_size)
        self.prefix_cache = PrefixCache(pool, page_size) if prefix_caching else None
        self.encoder_cache = EncoderCache(encoder_cache_tokens)  # (untouched by sequences without images)
        self.max_encoder_tokens = max_encoder_tokens
        self.admission = Admission(max_batch_size, self.pages, self.prefix_cache, self.encoder_cache)
        self.preemption = Preemption(self.admission, self.pages, self.encoder_cache)

    def add(self, seq: Sequence) -> None:
        self.admission.add(seq)

    def plan(self, depth: int) -> Step | None:
        rows = choose_decode_rows(self.running, depth, self.max_batch_size, self.max_step_tokens,
                                  self.page_size, self._reserve)
        budget = self.max_step_tokens - len(rows.decode)
        prompts = self._admit(rows.prompts, min(self.max_batch_size - len(rows.decode), budget), rows.blocked)
        encoder = EncoderBudget(self.encoder_cache, self.max_encoder_tokens)
        chunks, chunk_seqs = self._chunks(prompts, budget, encoder)
        if not rows.decode and not chunks:
            return None  # (page writes wait for the next step that is planned)
        return Step(rows.decode, chunks, chunk_seqs, self.pages.take_writes(), encoder.encodes)

    def _admit(self, prompts: list[Sequence], room: int, blocked: bool) -> list[Sequence]:
        """Prompts that can still join, up to `room`: running ones first (a decode row's victims are
        admitted after it: none of these), then new admissions unless a decode row was blocked."""
        prompts = prompts[:max(room, 0)]
        while not blocked and len(prompts) < room and (seq := self.admission.admit()) is not None:
            prompts.append(seq)
        return prompts

    def _chunks(self, prompts: list[Sequence], budget: int, encoder: EncoderBudget
                ) -> tuple[list[SeqWork], list[Sequence]]:
        """Each prompt's chunk of its fair share of `budget`, where its pages can be had without
        preempting and its images' encodes fit the step's encoder budget."""
        chunks, chunk_seqs = [], []
        for seq, share in zip(prompts, prompt_shares(prompts, budget)):
            encodes: list = []
            if seq.images and share > 0:
                share, encodes = encoder.cut(seq, share)
            if share < seq.min_chunk:  # the encoder budget cut its bidirectional prefix: next step
                continue
            work = next_chunk(seq, share) if share > 0 else None
            if work is None or not self._reserve(seq, work.end_pos, victims=[]):
                continue
            encoder.take(encodes)
            chunks.append(work)
            chunk_seqs.append(seq)
        return chunks, chunk_seqs

    def _reserve(self, seq: Sequence, end_pos: int, victims: list[Sequence]) -> bool:
        """Pages for positions up to `end_pos`, preempting the newest of `victims` if none are free."""
        need = seq.pages_needed(end_pos, self.page_size)
        if not self.preemption.make_room(seq, need, victims):
            return False
        if need > 0:
            self.pages.give(seq, need)
        return True

    # --- the Pipeline's calls when a sequence ends -------------------------------------------------

    def release(self, seq: Sequence) -> None:
        self.preemption.release(seq)

    def drop_waiting(self, seq: Sequence) -> None:
        self.admission.drop_waiting(seq)

    # --- state the engine loop, its metrics and the tests read -------------------------------------

    @property
    def running(self) -> list[Sequence]:
        return self.admission.running

    @property
    def waiting(self) -> deque[Sequence]:
        return self.admission.waiting

    @property
    def num_waiting(self) -> int:
        return self.admission.num_waiting

    @property
    def num_preemptions(self) -> int:
        return self.preemption.num_preemptions

    def pages_pending_release(self) -> int:
        return self.preemption.pages_pending_release()

    def has_work(self) -> bool:
        return self.num_waiting > 0 or any(not s.finished for s in self.running)

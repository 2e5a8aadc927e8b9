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

The steady batch. Most steps change nothing: no sequence joins or leaves. After a plan whose step
has only decode rows and leaves nobody out (no prompt to chunk, no row blocked, nobody admissible),
the Planner keeps that step's decode list and hands it out again, untouched, step after step
(`_repeat`). What a row will need is known when the batch forms: the step at which it runs out of
page positions, and the one at which it runs out of samples (max_tokens); each row is put on that
step's list (`_due`), so a repeat looks only at the rows due now: one that needs a page gets one
(the step carries the page-table entry; if the pool is short, a full plan decides who waits or is
preempted), one out of samples ends the batch. Anything else that could change the choice ends it
at once (`batch_changed`: a request added, finished or released, a failed step's page entries put
back, rejected drafts giving samples back to a row that had none left), and the next plan is a
full one. The engine loop launches the same ForwardInput for the same list again (with the step's
page entries, if any), which the runner reuses as it staged it.
With SLIPSTREAM_CHECK_INVARIANTS=1 (the tests) each repeat is checked against what a full choice of
decode rows would give.
"""
from __future__ import annotations

import os
from collections import deque

from slipstream.errors import PipelineInvariantError
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
from slipstream.speculation.policy import Speculation
from slipstream.scheduler.step import Step


class Planner:
    def __init__(self, pool: PagePool, page_size: int, max_batch_size: int, max_step_tokens: int,
                 prefix_caching: bool = False, encoder_cache_tokens: int = 0, max_encoder_tokens: int = 0,
                 kv_window: int | None = None):
        self.pool, self.page_size = pool, page_size
        # every layer's sliding window (the largest): a running sequence's pages wholly before it are
        # given back (PageReservation.release_before); None: the model attends to the whole context
        self.kv_window = kv_window
        self.max_batch_size, self.max_step_tokens = max_batch_size, max_step_tokens
        self.pages = PageReservation(pool, page_size)
        self.prefix_cache = PrefixCache(pool, page_size) if prefix_caching else None
        self.encoder_cache = EncoderCache(encoder_cache_tokens)  # (untouched by sequences without images)
        self.max_encoder_tokens = max_encoder_tokens
        self.admission = Admission(max_batch_size, self.pages, self.prefix_cache, self.encoder_cache)
        self.preemption = Preemption(self.admission, self.pages, self.encoder_cache)
        self._steady: list[Sequence] | None = None  # the steady batch's decode rows (None: plan in full)
        self._plans = 0  # plans made: the steady batch's clock
        self._due: dict[int, list[Sequence | None]] = {}  # plan -> steady rows to look at then (None: its end)
        self.check = os.environ.get("SLIPSTREAM_CHECK_INVARIANTS") == "1"
        self.speculation: Speculation | None = None  # drafts per decode row (EngineConfig.speculative)

    def add(self, seq: Sequence) -> None:
        self.admission.add(seq)
        self.batch_changed()

    def batch_changed(self) -> None:
        """Something the choice of decode rows depends on changed: the next plan is a full one (and
        nothing here keeps a finished sequence alive)."""
        self._steady = None
        self._due = {}

    def plan(self, depth: int) -> Step | None:
        self._plans += 1
        if self._steady is not None:
            step = self._repeat(self._steady)
            if step is not None:
                if self.check:
                    self._check_steady(self._steady, depth)
                return step
        step = self._full_plan(depth)
        if self.speculation is not None and step is not None:
            self.speculation.draft(step, self)
        return step

    def _repeat(self, steady: list[Sequence]) -> Step | None:
        """The steady batch again, with pages for the rows that need one now; None: it ended."""
        due = self._due.pop(self._plans, None)
        if due is not None:
            for seq in due:
                if seq is None:  # (end_steady_at: speculation plans again)
                    self.batch_changed()
                    return None
                if seq.max_tokens - len(seq.output_ids) - seq.pending_samples <= 0:
                    self.batch_changed()  # out of samples: it leaves the batch
                    return None
                self._release_window(seq)  # (due at each new page: what it crossed since the last)
                end = seq.num_scheduled + 1
                if end > len(seq.pages) * self.page_size and not self._reserve(seq, end, victims=[]):
                    self.batch_changed()  # the pool is short: a full plan decides
                    return None
                self._schedule(seq)
        return Step(steady, [], [], self.pages.take_writes() if due else [])

    def _schedule(self, seq: Sequence) -> None:
        """Put a steady row on the list of the plan at which it runs out of page positions or of
        samples, whichever comes first (counting from this plan, before its step is launched)."""
        left = seq.max_tokens - len(seq.output_ids) - seq.pending_samples
        room = len(seq.pages) * self.page_size - seq.num_scheduled
        self._due.setdefault(self._plans + min(left, room), []).append(seq)

    def _release_window(self, seq: Sequence) -> None:
        """Give back its pages wholly before every layer's window of the lowest position a step of it
        will still compute (num_computed: the committed ones are done, the in-flight ones start there):
        a query at p reads keys from p - window + 1 on."""
        if self.kv_window is not None and not seq.finished and seq.row is not None:
            self.pages.release_before(seq, seq.num_computed - self.kv_window + 1)

    def _full_plan(self, depth: int) -> Step | None:
        self.batch_changed()
        if self.kv_window is not None:
            for seq in self.running:
                self._release_window(seq)
        rows = choose_decode_rows(self.running, depth, self.max_batch_size, self.max_step_tokens,
                                  self.page_size, self._reserve)
        budget = self.max_step_tokens - len(rows.decode)
        room = min(self.max_batch_size - len(rows.decode), budget)
        prompts = self._admit(rows.prompts, room, rows.blocked)
        chunks, chunk_seqs, encodes = self._chunks(prompts, budget) if prompts else ([], [], [])
        if not rows.decode and not chunks:
            return None  # (page writes wait for the next step that is planned)
        drops = self.encoder_cache.take_dropped() if self.encoder_cache.dropped else []
        if not prompts and not rows.blocked and (self.num_waiting == 0 or room <= 0 or not self.admission.free_rows):
            self._steady, self._due = rows.decode, {}  # (nobody to admit until a change)
            for seq in rows.decode:
                self._schedule(seq)
        return Step(rows.decode, chunks, chunk_seqs, self.pages.take_writes(), encodes, drops)

    def _check_steady(self, steady: list[Sequence], depth: int) -> None:
        """The repeat equals a full choice of decode rows made now, which would reserve no page."""
        def no_page(seq: Sequence, end: int, victims: list[Sequence]) -> bool:
            raise PipelineInvariantError(f"{seq.request_id} needs a page in a steady step")

        rows = choose_decode_rows(self.running, depth, self.max_batch_size, self.max_step_tokens,
                                  self.page_size, no_page)
        room = min(self.max_batch_size - len(rows.decode), self.max_step_tokens - len(rows.decode))
        if rows.decode != steady or rows.prompts or (self.num_waiting and room > 0 and self.admission.free_rows):
            raise PipelineInvariantError(f"a steady step of {len(steady)} rows where a full plan would choose "
                                         f"{len(rows.decode)} rows and {len(rows.prompts)} prompts")

    def _admit(self, prompts: list[Sequence], room: int, blocked: bool) -> list[Sequence]:
        """Prompts that can still join, up to `room`: running ones first (a decode row's victims are
        admitted after it: none of these), then new admissions unless a decode row was blocked."""
        prompts = prompts[:max(room, 0)]
        while not blocked and len(prompts) < room and (seq := self.admission.admit()) is not None:
            prompts.append(seq)
        return prompts

    def _chunks(self, prompts: list[Sequence], budget: int) -> tuple[list[SeqWork], list[Sequence], list]:
        """Each prompt's chunk of its fair share of `budget`, where its pages can be had without
        preempting and its images' encodes fit the step's encoder budget; and those encodes."""
        chunks, chunk_seqs = [], []
        encoder = None
        for seq, share in zip(prompts, prompt_shares(prompts, budget)):
            encodes: list = []
            if seq.images is not None and share > 0:
                if encoder is None:  # (a step without images never makes one)
                    encoder = EncoderBudget(self.encoder_cache, self.max_encoder_tokens)
                share, encodes = encoder.cut(seq, share)
            if share < seq.min_chunk:  # the encoder budget cut its bidirectional prefix: next step
                continue
            work = next_chunk(seq, share) if share > 0 else None
            if work is None or not self._reserve(seq, work.end_pos, victims=[]):
                continue
            if encodes and encoder is not None:  # (only an encoder budget gives encodes)
                encoder.take(encodes)
            chunks.append(work)
            chunk_seqs.append(seq)
        return chunks, chunk_seqs, encoder.encodes if encoder is not None else []

    def _reserve(self, seq: Sequence, end_pos: int, victims: list[Sequence]) -> bool:
        """Pages for positions up to `end_pos`, preempting the newest of `victims` if none are free."""
        need = seq.pages_needed(end_pos, self.page_size)
        if not self.preemption.make_room(seq, need, victims):
            return False
        if need > 0:
            self.pages.give(seq, need)
        return True

    @property
    def plans(self) -> int:
        """Plans made so far (full or steady)."""
        return self._plans

    def steady_from(self, step: Step) -> bool:
        """Whether `step` (just planned) starts a steady batch."""
        return self._steady is step.decode

    def end_steady_at(self, plans: int) -> None:
        """The steady batch ends `plans` plans from now (speculation: a row may draft again)."""
        self._due.setdefault(self._plans + plans, []).append(None)

    def reserve_free(self, seq: Sequence, end_pos: int) -> bool:
        """Pages for positions up to `end_pos` from free ones only (drafts never preempt)."""
        need = seq.pages_needed(end_pos, self.page_size)
        if need > self.pages.num_free:
            return False
        if need > 0:
            self.pages.give(seq, need)
        return True

    # --- the Pipeline's calls when a sequence ends -------------------------------------------------

    def release(self, seq: Sequence) -> None:
        self.preemption.release(seq)
        self.batch_changed()

    def drop_waiting(self, seq: Sequence) -> None:
        self.admission.drop_waiting(seq)
        self.batch_changed()

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

"""Preemption and release: making room for a page a running sequence needs, and giving back a
sequence's pages and row once no step in flight references it.

Rules, enforced here:
  * A row that needs a page it cannot get makes the most recently admitted unplanned sequence
    (possibly itself) a preemption victim; its pages return when its inflight_refs reaches 0 and it
    is recomputed from its known tokens.
  * Release drops the sequence's page references and its encoder-cache references; pages the prefix cache registered stay hittable
    (a preempted sequence's recompute can hit its own prefix), the rest are free at once.
  * Pages that in-flight victims and zombies will return at their commits count as coming: if they
    cover the need, the row skips this step instead of preempting more (at depth 2 a victim frees
    nothing until its step commits).
"""
from __future__ import annotations

from slipstream.scheduler.admission import Admission
from slipstream.scheduler.encoder_cache import EncoderCache
from slipstream.scheduler.page_reservation import PageReservation
from slipstream.scheduler.sequence import Sequence, SeqStatus


class Preemption:
    def __init__(self, admission: Admission, pages: PageReservation, encoder_cache: EncoderCache | None = None):
        self.admission, self.pages, self.encoder_cache = admission, pages, encoder_cache
        self.num_preemptions = 0

    def make_room(self, seq: Sequence, need: int, victims: list[Sequence]) -> bool:
        """Free pages until `need` fit, preempting the newest of `victims`; False: `seq` skips this step."""
        while need > self.pages.num_free:
            if need <= self.pages.num_free + self.pages_pending_release():
                return False  # in-flight victims and zombies will return enough: skip this step
            victim = next((v for v in reversed(victims) if v.preemptible), None)
            if victim is None:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def pages_pending_release(self) -> int:
        """Pages that finished or preempted sequences still in flight return at their commits."""
        refcount = self.pages.pool.refcount  # a page another sequence shares does not come back
        return sum(sum(refcount(p) == 1 for p in s.pages) for s in self.admission.running
                   if (s.finished or s.preempting) and s.inflight_refs > 0)

    def preempt(self, seq: Sequence) -> None:
        seq.preempting = True
        self.num_preemptions += 1
        seq.num_preemptions += 1
        if seq.inflight_refs == 0:
            self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Return a sequence's pages and row. Only legal with no step in flight referencing it."""
        assert seq.inflight_refs == 0, f"{seq.request_id}: released with {seq.inflight_refs} steps in flight"
        self.pages.free(seq)
        if self.encoder_cache is not None:
            self.encoder_cache.release(seq)  # (a victim takes its references again when re-admitted)
        self.admission.dismiss(seq)
        seq.last_token_on_device = False
        if seq.finished:
            seq.status = SeqStatus.RELEASED
        elif seq.preempting:  # recompute later from its known tokens, ahead of new arrivals
            seq.preempting = False
            seq.num_scheduled = seq.num_computed = seq.prefix.num_registered_pages = 0
            self.admission.requeue(seq)

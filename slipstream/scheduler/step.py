"""One step of the engine loop, as the scheduler sees it: what the Planner chose, then what launch
adds. The runner-side input it is packed into is runtime/batch.py's `ForwardInput`; the runner's
record of its launch is a `Launched` (runtime/runner_api.py; a LaunchedStep on a device).

While the batch is steady the Planner hands out the same `decode` list step after step (the
persistent batch): the loop then launches the same ForwardInput again (EngineLoop._pack)."""
from __future__ import annotations

from dataclasses import dataclass, field

from slipstream.runtime.batch import ForwardInput, ImageSpan, SeqWork
from slipstream.runtime.runner_api import Launched
from slipstream.scheduler.sequence import Sequence


@dataclass(eq=False)
class Step:
    # planned (Planner.plan): decode rows first (one device-fed token each, all sampled), then chunks
    # of host-known tokens; `page_writes` are the page-table entries handed out since the last step
    decode: list[Sequence]
    chunks: list[SeqWork]
    chunk_seqs: list[Sequence]
    page_writes: list[int]  # flat (row, index, page) triples
    encodes: list[ImageSpan] = field(default_factory=list)  # images encoded right before its forward
    drops: list[bytes] = field(default_factory=list)  # encoder outputs the encoder cache evicted: dropped first
    # drafts per decode row (speculation/policy.py); None: a step without drafts (never speculating)
    drafts: list[int] | None = None
    # launched (set by EngineLoop.launch; reading one earlier raises)
    step_id: int = field(init=False, repr=False)
    packed: ForwardInput = field(init=False, repr=False)
    launched: Launched = field(init=False, repr=False)  # the runner's record of it (its slot, its events)
    late_rows: list[int] = field(default_factory=list)  # sampling rows whose mask needs commit t-1
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def seqs(self) -> list[Sequence]:
        return self.decode + self.chunk_seqs

    @property
    def kind(self) -> str:
        return "prefill" if self.chunks else "decode"

    def sampling_seqs(self) -> list[Sequence]:
        """Sequences in sampling-row order: every decode row, then chunks that sample."""
        return self.decode + [s for s, w in zip(self.chunk_seqs, self.chunks) if w.sample]

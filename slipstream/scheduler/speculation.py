"""How many drafts each decode row of a step feeds (docs/speculative.md), and each row's acceptance
estimate. Pure Python; used only when `EngineConfig.speculative` is set.

Rules, enforced here:
  * Only a step without prompt chunks speculates, and only when every row's sampling is one the
    device verifies on its own: no grammar, logprobs, penalties, min_tokens or carry (a speculating
    step is sampled right behind its forward, and returns runs of tokens only). A row's
    k never makes a sample past max_tokens: k <= samples_left - 1, counted against the optimistic
    `pending_samples`.
  * The host plans as if every draft were accepted: a row with k drafts schedules k + 1 positions
    and k + 1 samples (`drafts_in_flight` += k), and its pages cover them (extra pages only from
    free ones: a draft never preempts). The device knows the truth (runtime/spec_step.py); the
    commit corrects the counts by what was emitted (`Pipeline._commit_runs`).
  * A speculating batch is never steady: the plan after a step with drafts is a full one. A batch
    whose rows all chose no drafts stays steady until the first of them is due to probe.

Adaptive k (`adaptive=True`): a row's per-draft acceptance alpha is estimated from its commits
(decayed counts); it feeds the k that maximises E(k) / (c(k + 1) + s), E(k) = (1 - alpha^(k+1)) /
(1 - alpha) the expected tokens of a step, c the forward's cost by positions relative to one position
(`FORWARD_COST`, measured) and s a speculating step's own work (`STEP_COST`), if that beats 1 / c(1)
by `MARGIN`; a row that does not draft probes again with one draft every `PROBE_EVERY` plans (more,
up to `MAX_PROBE_EVERY`, the lower its estimate), so its estimate can recover.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from slipstream.scheduler.sequence import Sequence

if TYPE_CHECKING:
    from slipstream.scheduler.planner import Planner
    from slipstream.scheduler.step import Step

# CPU time of a forward of one sequence feeding q positions (logits at each) at 256 tokens of context,
# relative to q = 1: the default model (SmolLM2-135M Q4_1, quantized kernels), one thread; linear between.
# docs/results/spec-2026-11-27/forward_cost_quantized.txt
FORWARD_COST = {1: 1.0, 2: 1.12, 3: 1.28, 5: 1.80, 9: 3.47}
# a speculating step's own work beside its forward (drafting, verifying, the host's runs), relative to
# a one-position forward: ~0.25 ms against ~6 ms (tools/bench_spec_kernels.py; docs/speculative.md)
STEP_COST = 0.04
MARGIN = 1.05  # speculate only when the expected gain is at least 5%
PROBE_EVERY = 8  # plans between probes of a row whose drafts do not pay, at alpha = 0.5; more below it
MAX_PROBE_EVERY = 64
DECAY = 0.8  # weight of the past in a row's acceptance counts, per commit
PRIOR = (1.0, 2.0)  # (accepted, tried) a row starts from: alpha = 0.5


def forward_cost(q: int) -> float:
    points = sorted(FORWARD_COST.items())
    for (q0, c0), (q1, c1) in zip(points, points[1:]):
        if q <= q1:
            return c0 + (c1 - c0) * (q - q0) / (q1 - q0)
    (q0, c0), (q1, c1) = points[-2], points[-1]
    return c1 + (c1 - c0) * (q - q1) / (q1 - q0)


def best_drafts(alpha: float, max_drafts: int) -> int:
    """The k in 0..max_drafts with the most expected tokens per unit of forward cost (0 unless it
    beats plain decoding by MARGIN)."""
    best, best_rate = 0, MARGIN
    for k in range(1, max_drafts + 1):
        tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        rate = tokens / (forward_cost(k + 1) + STEP_COST)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


def can_speculate(seq: Sequence) -> bool:
    """Its sampling is verified on the device alone (replay of greedy or random draws)."""
    s = seq.sampling
    return (seq.matcher is None and not s.logprobs and not s.top_logprobs and not s.carry
            and not s.needs_history)


class Speculation:
    def __init__(self, max_drafts: int, adaptive: bool = True):
        self.max_drafts, self.adaptive = max_drafts, adaptive
        self.drafted = 0  # drafts fed (committed steps, live rows)
        self.accepted = 0  # of which accepted
        self.steps = 0  # committed steps with drafts

    @staticmethod
    def alpha(seq: Sequence) -> float:
        return (seq.drafts_accepted + PRIOR[0]) / (seq.drafts_tried + PRIOR[1])

    @staticmethod
    def probe_every(alpha: float) -> int:
        return min(MAX_PROBE_EVERY, max(PROBE_EVERY, int(PROBE_EVERY * 0.5 / max(alpha, 1e-3))))

    def wanted(self, seq: Sequence) -> int:
        if not self.adaptive:
            return self.max_drafts
        alpha = self.alpha(seq)
        k = best_drafts(alpha, self.max_drafts)
        if k == 0 and seq.steps_without_drafts >= self.probe_every(alpha):
            k = 1
        return k

    def draft(self, step: Step, planner: Planner) -> None:
        """Set `step.drafts` (k per decode row) and reserve the pages the drafts write. A batch whose
        rows draft is never steady; one whose rows do not may be, until the first probe is due."""
        if step.chunks:
            for seq, work in zip(step.chunk_seqs, step.chunks):
                if work.start_pos == seq.num_reused > 0:  # the history before a prefix-cache hit's end
                    work.known_before = seq.known_tokens(0, work.start_pos)
            return
        if not step.decode or not all(map(can_speculate, step.decode)):
            return
        page_size = planner.page_size
        ks = []
        for seq in step.decode:
            k = self.wanted(seq)
            k = min(k, seq.max_tokens - len(seq.output_ids) - seq.pending_samples - 1)
            if k > 0:
                end = seq.num_scheduled + 1 + k
                if end > len(seq.pages) * page_size and not planner.reserve_free(seq, end):
                    k = 0
            if k > 0:
                seq.steps_without_drafts = 0
            else:
                k = 0
                seq.steps_without_drafts += 1
            ks.append(k)
        if any(ks):
            planner.batch_changed()
            step.drafts = ks
            writes = planner.pages.take_writes()
            if writes:
                step.page_writes = step.page_writes + writes
        elif self.adaptive and planner.steady_from(step):
            # the batch repeats without plans until a row's probe is due; the plans it skips count
            wait = max(1, min(self.probe_every(self.alpha(seq)) - seq.steps_without_drafts for seq in step.decode))
            for seq in step.decode:
                seq.steps_without_drafts += wait - 1
            planner.end_steady_at(wait)

    def on_commit(self, seq: Sequence, k: int, emitted: int) -> None:
        """A live row's step with k drafts emitted `emitted` tokens: its acceptance estimate."""
        accepted = emitted - 1
        seq.drafts_accepted = seq.drafts_accepted * DECAY + accepted
        seq.drafts_tried = seq.drafts_tried * DECAY + accepted + (accepted < k)
        self.drafted += k
        self.accepted += accepted
        self.steps += 1

    def stats(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "steps": self.steps,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": self.accepted / self.steps if self.steps else 0.0}

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
    free ones: a draft never preempts). The device knows the truth (speculation/runner.py); the
    commit corrects the counts by what was emitted (`Pipeline._commit_runs`).
  * A speculating batch is never steady: the plan after a step with drafts is a full one. A batch
    whose rows all chose no drafts stays steady until the first of them is due to probe, or until a
    commit rejects drafts of a row that plans left out for having no sample left (as if accepted):
    it decodes again (`Pipeline._commit_runs` ends the batch).

Adaptive k (`adaptive=True`): a row's per-draft acceptance alpha is estimated from its commits
(decayed counts of the drafts it fed), and so is its match rate m (of its steps planned with drafts,
the share where the device fed any: on the CPU a weak n-gram match feeds none); the step takes drafts
in the order of the expected tokens they add (a row's j-th: m * alpha^j) as far as its expected
tokens per unit of cost are highest, the cost being the forward's by expected positions
(`FORWARD_MS`, measured) plus each speculating row's own work (`row_ms`: at least `ROW_MS`, more for
a drafter that measures dearer), and speculates only if that beats the step without drafts by
`MARGIN` (`allocate`). A row that does not draft probes again with one draft every `PROBE_EVERY`
plans (more, up to `MAX_PROBE_EVERY`, the lower its estimate; more still where a probe is dear: its
cost stays under `PROBE_SHARE` of the plans between probes), so its estimate can recover.

Shadow probes (`shadow`: the n-gram drafter, whose rule runs on the host's tokens too): in a step
that does not speculate, a row is probed at a plain commit instead, without a draft fed: the
drafter's first draft after the tokens the host has (which end right before the token being
committed) is scored against the token sampled, fed or not as the device would have fed it
(`on_plain_commit`). No probe then moves a batch onto the speculating path; a probe that feeds its
draft is left only for a row the shadows find worth drafting while the measured penalty says no
(it prices the path again: a cold first step, a changed load), as rarely as its cost allows. A
steady batch plans again when a shadow probe says a row's drafts pay. The first speculating step
pays first-call costs and is not taken as the path's price.

What the device measures (`timed`, every device the engine builds): with speculation on, every
unmasked step's time on the compute stream comes back (`SampledTokens.step_ms`: CUDA's timing events,
the CPU compute thread's CPU time, which other processes on a shared machine do not inflate). Plain
decode steps give the device's ms per unit of the cost table by bucket of rows; a speculating step's
ms over what that and the table predict is its `penalty` (decayed, at least 1), which prices every
draft and every probe: on CUDA, where a speculating step ran eagerly beside graphed plain steps, it
was several times the table's; on a CPU whose multi-position forward is dearer than on the table's
machine, above 1; past some penalty drafts stop paying. A probe in a step that would not speculate
otherwise moves the whole batch onto that path, so it is priced as such (`probe_every(alpha, batch)`).

A drafter's cost: where the device measures it (the CPU), a speculating step's result carries its
proposal's time over its forward's (`SampledTokens.draft_cost`); `on_draft_cost` keeps a decayed
mean of a row's share in the cost table's unit (`Speculation.draft_cost`, in stats()). A draft model
that recomputes its context costs several forwards per proposal, an n-gram lookup a few percent of
one: one policy prices both.
"""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from typing import Any, Callable, Protocol


# The scheduler's types as drafting sees them (a layer below the scheduler: its Sequence and Step are
# not imported; tests/test_layering.py). Only what the policy reads and writes.
class Row(Protocol):
    """A decode row: the scheduler's Sequence (scheduler/sequence.py)."""

    speculate: bool  # SamplingParams.speculative
    matcher: Any  # its grammar's matcher, or None
    sampling: Any  # its SamplingParams
    max_tokens: int
    prompt_ids: list[int]
    output_ids: list[int]
    pending_samples: int
    num_scheduled: int
    pages: list[int]
    prefix: Any  # its PrefixState (num_reused: tokens a prefix-cache hit mapped)
    drafts_accepted: float
    drafts_tried: float
    draft_plans: float
    draft_feeds: float
    steps_without_drafts: int
    shadow_at: int  # the plain commit (Speculation.commits) at which its next shadow probe is due; 0: none
    finished: bool

    def known_tokens(self, start: int, end: int) -> list[int]: ...


class DraftStep(Protocol):
    """A planned step: the scheduler's Step (scheduler/step.py)."""

    drafts: list[int] | None
    page_writes: list[int]

    @property
    def decode(self) -> Seq[Row]: ...

    @property
    def chunks(self) -> Seq[Any]: ...  # its SeqWork: start_pos, known_before

    @property
    def chunk_seqs(self) -> Seq[Row]: ...


class Planner(Protocol):
    """What drafting needs of the Planner (scheduler/planner.py), which owns a Speculation."""

    page_size: int
    pages: Any  # its PageReservation: the entries a step carries

    @property
    def plans(self) -> int: ...

    def batch_changed(self) -> None: ...

    def reserve_free(self, seq: Any, end_pos: int) -> bool: ...

    def steady_from(self, step: Any) -> bool: ...

    def end_steady_at(self, plans: int) -> None: ...

# CPU time (ms) of a forward by the positions it feeds (logits at each), at 256 tokens of context: the
# default model (SmolLM2-135M Q4_1, quantized kernels), one thread; one sequence up to 9 positions,
# 8 sequences from 8; linear between. Only the shape matters: a step's cost relative to the same step
# without drafts. By EngineConfig.activations: float32 (docs/results/spec-2026-11-27/
# forward_cost_quantized*.txt), int8 (forward_cost_int8*.txt) and int16 (forward_cost_int16*.txt),
# where a position costs less. (positions, ms) in ascending positions: forward_cost walks them as they are.
FORWARD_MS = ((1, 6.0), (2, 6.71), (3, 7.68), (5, 10.79), (8, 21.3), (16, 34.8), (24, 46.5), (40, 71.1))
FORWARD_MS_INT8 = ((1, 5.99), (2, 6.69), (3, 7.39), (5, 8.61), (8, 14.66), (16, 23.89), (24, 31.12), (40, 45.61))
FORWARD_MS_INT16 = ((1, 7.39), (2, 8.2), (3, 8.64), (5, 10.43), (8, 18.88), (16, 31.77), (24, 43.86), (40, 62.74))
FORWARD_MS_BY_ACTIVATIONS = {"float": FORWARD_MS, "int8": FORWARD_MS_INT8, "int16": FORWARD_MS_INT16}
CostTable = tuple[tuple[int, float], ...]
# a speculating row's own work beside the forward (drafting, verifying, its run on the host), in
# the same unit: ~0.25 ms (tools/spec/bench_spec_kernels.py; docs/speculative.md)
ROW_MS = 0.25
PROBE_SHARE = 0.02  # a probe (its drafter's work and one more position) costs at most this share of the plans between probes
MARGIN = 1.05  # speculate only when the expected gain is at least 5%
PROBE_EVERY = 8  # plans between probes of a row whose drafts do not pay, at alpha = 0.5; more below it
MAX_PROBE_EVERY = 64
DECAY = 0.8  # weight of the past in a row's acceptance counts, per commit
PRIOR = (1.0, 2.0)  # (accepted, tried) a row starts from: alpha = 0.5
MATCH_PRIOR = (1.0, 1.0)  # (fed, planned) a row starts from: m = 1


def forward_cost(positions: float, costs: CostTable = FORWARD_MS) -> float:
    for (q0, c0), (q1, c1) in zip(costs, costs[1:]):
        if positions <= q1:
            return c0 + (c1 - c0) * (positions - q0) / (q1 - q0)
    (q0, c0), (q1, c1) = costs[-2], costs[-1]
    return c1 + (c1 - c0) * (positions - q1) / (q1 - q0)


def allocate(alphas: list[float], max_drafts: int, costs: CostTable = FORWARD_MS, row_ms: float = ROW_MS,
             matches: list[float] | None = None, penalty: float = 1.0) -> list[int]:
    """Drafts per row for a step of these rows (their acceptance estimates, and match rates: 1 if not
    given). A row's j-th draft adds m * alpha^j expected tokens (the device feeds it, and it and the
    drafts before it are accepted) and m positions; taking drafts in the order of what they add, the
    step keeps the prefix with the most expected tokens per unit of cost, the cost being the forward's
    by expected positions plus each speculating row's own work (paid whether it feeds or not), times
    `penalty` (what the device measured a speculating step to cost over that); none unless that beats
    the step without drafts by MARGIN. At a larger batch, where positions cost more,
    fewer drafts pay."""
    n = len(alphas)
    ks = [0] * n
    if not n:
        return ks
    match = matches or [1.0] * n
    order = sorted(((match[i] * a ** j, i) for i, a in enumerate(alphas) for j in range(1, max_drafts + 1)),
                   reverse=True)
    base = n / forward_cost(n, costs)
    tokens, positions, rows, best, best_at = float(n), float(n), 0, base, 0
    taken = [0] * n
    for m, (gain, i) in enumerate(order, 1):
        if gain <= 0:
            break
        rows += taken[i] == 0
        taken[i] += 1
        tokens += gain
        positions += match[i]
        rate = tokens / (penalty * (forward_cost(positions, costs) + row_ms * rows))
        if rate > best:
            best, best_at = rate, m
    if best < base * MARGIN:
        return ks
    for _, i in order[:best_at]:
        ks[i] += 1
    return ks


def best_drafts(alpha: float, max_drafts: int, costs: CostTable = FORWARD_MS, row_ms: float = ROW_MS,
                penalty: float = 1.0, match: float = 1.0) -> int:
    """One row alone: `allocate` of a batch of one."""
    return allocate([alpha], max_drafts, costs, row_ms, [match], penalty)[0]


def _bucket(rows: int) -> int:
    return 1 << max(rows - 1, 0).bit_length()


def can_speculate(seq: Row) -> bool:
    """Its sampling is verified on the device alone (replay of greedy or random draws), and its
    request did not opt out (SamplingParams.speculative)."""
    s = seq.sampling
    return (seq.speculate and seq.matcher is None and not s.logprobs and not s.top_logprobs and not s.carry
            and not s.needs_history)


class Speculation:
    def __init__(self, max_drafts: int, adaptive: bool = True, costs: CostTable = FORWARD_MS, timed: bool = False):
        self.max_drafts, self.adaptive = max_drafts, adaptive
        # the device times steps (SampledTokens.step_ms): a bucket of rows speculates only once a plain
        # step of it was measured, so its first speculating step is priced against something
        self.timed = timed
        self.costs = costs  # the forward's cost by positions (FORWARD_MS_BY_ACTIVATIONS)
        self.row_ms = ROW_MS  # a speculating row's own work, in the table's unit (on_draft_cost)
        self.draft_cost: float | None = None  # decayed mean of a row's proposal, in the table's unit, where measured
        # what the device measures (SampledTokens.step_ms): a plain decode step's ms per table unit, by
        # bucket of rows, and a speculating step's cost over what the table and that predict (decayed;
        # the policy uses it, at least 1: on CUDA an eager speculating step costs several graphed ones)
        self.unit_ms: dict[int, float] = {}
        self.measured_penalty: float | None = None
        self.penalty = 1.0
        self._pricing = False  # the first speculating step is in flight: none more until it is priced
        self._warm = False  # a speculating step was measured (the first is not counted)
        self._steady: tuple[Seq[Row], int] | None = None  # a steady batch's rows and the plan it began at
        self.drafted = 0  # drafts fed (committed steps, live rows)
        self.accepted = 0  # of which accepted
        self.steps = 0  # committed steps with drafts
        # shadow probes (`on_plain_commit`): a row that does not draft is probed on the host, without a
        # draft fed, where the drafter can propose from the host's tokens (the n-gram drafter):
        # shadow(tokens) -> (its first draft after them, whether the device would have fed it)
        self.shadow: Callable[[list[int]], tuple[int, bool]] | None = None
        self.shadow_window = 0  # the newest tokens the proposal reads (the drafter's window)
        self.commits = 0  # plain decode steps committed
        self._shadow_due: dict[int, list[Row]] = {}  # commit -> rows whose shadow probe is due then
        self.shadow_probes = 0
        self.shadow_hits = 0  # of which the draft was the token sampled

    @staticmethod
    def alpha(seq: Row) -> float:
        return (seq.drafts_accepted + PRIOR[0]) / (seq.drafts_tried + PRIOR[1])

    @staticmethod
    def match(seq: Row) -> float:
        return (seq.draft_feeds + MATCH_PRIOR[0]) / (seq.draft_plans + MATCH_PRIOR[1])

    def probe_every(self, alpha: float, batch: int = 0, fed: bool = False) -> int:
        """Plans between a row's probes. In a step that speculates anyway (`batch` 0) a probe costs its
        drafter's work and one more position; otherwise it moves the whole step of `batch` rows onto the
        speculating path, priced by the measured penalty, and each of the rows may be the one that
        does: the interval keeps all of them within PROBE_SHARE of the plans between probes. A shadow
        probe costs the device nothing: only the estimate sets its interval (`fed`: a probe that feeds
        its draft although shadow probes exist, priced as one)."""
        by_alpha = min(MAX_PROBE_EVERY, max(PROBE_EVERY, int(PROBE_EVERY * 0.5 / max(alpha, 1e-3))))
        if batch and self.shadow is not None and not fed:
            return by_alpha
        rows, c = max(batch, 1), self.costs
        one = forward_cost(rows, c)
        if batch:
            probe = batch * (self.penalty * (forward_cost(rows + 1, c) + self.row_ms) - one)
        else:
            probe = self.penalty * (self.row_ms + forward_cost(2, c) - forward_cost(1, c))
        return max(by_alpha, math.ceil(probe / (one * PROBE_SHARE) - 1e-9))

    def on_step_cost(self, rows: int, positions: int, speculating_rows: int, ms: float) -> None:
        """A decode step of `rows` rows fed `positions` positions and took `ms` on the device
        (`speculating_rows` of them fed drafts; 0: a plain step). A plain step teaches the device's
        ms per table unit at its bucket; a speculating one its cost over what that predicts."""
        c, b = self.costs, _bucket(rows)
        if not speculating_rows:
            unit = ms / forward_cost(rows, c)
            prev = self.unit_ms.get(b)
            self.unit_ms[b] = unit if prev is None else DECAY * prev + (1 - DECAY) * unit
            return
        self._pricing = False
        if not self._warm:  # the first speculating step pays first-call costs: not the path's price
            self._warm = True
            return
        known = self.unit_ms.get(b)
        if known is None:  # no plain step of its size measured yet: nothing to compare with
            return
        ratio = ms / (known * (forward_cost(positions, c) + self.row_ms * speculating_rows))
        prev = self.measured_penalty
        penalty = ratio if prev is None else DECAY * prev + (1 - DECAY) * ratio
        self.measured_penalty, self.penalty = penalty, max(1.0, penalty)

    def on_draft_cost(self, ratio: float, rows: int, positions: int) -> None:
        """A speculating step of `rows` rows fed `positions` positions; its proposal took `ratio` times
        its forward's time (both measured on the compute stream): a row's share, in the table's unit."""
        ms = ratio * forward_cost(positions, self.costs) / rows
        self.draft_cost = ms if self.draft_cost is None else DECAY * self.draft_cost + (1 - DECAY) * ms
        self.row_ms = max(ROW_MS, self.draft_cost)

    def unpriced(self, rows: int) -> bool:
        """A timed device has not measured a plain step of this bucket yet, or prices its first
        speculating step now: no drafts until it has."""
        return self.timed and (_bucket(rows) not in self.unit_ms or self._pricing)

    def wanted(self, seqs: Seq[Row]) -> list[int]:
        """Drafts per row (before max_tokens and pages): all k without `adaptive`; else `allocate`
        by the rows' estimates, and one draft for a row that drafts none and is due to probe (with
        shadow probes, only a row they find worth drafting although the measured penalty says no)."""
        if not self.adaptive:
            return [self.max_drafts] * len(seqs)
        n, unpriced = len(seqs), self.unpriced(len(seqs))
        alphas = [self.alpha(seq) for seq in seqs]
        matches = [self.match(seq) for seq in seqs]
        ks = [0] * n if unpriced else allocate(alphas, self.max_drafts, self.costs, self.row_ms, matches, self.penalty)
        batch = 0 if any(ks) else n  # (a probe in a step that does not speculate moves all of it)
        if batch and self.shadow is not None:  # its rows are probed in the shadow
            for seq, a, m in zip(seqs, alphas, matches):
                if not seq.shadow_at:
                    self._schedule_shadow(seq, a * m)
            if unpriced:
                return ks
            due = [self._price_probe_in(seq, a, m, batch) for seq, a, m in zip(seqs, alphas, matches)]
            return [1 if d is not None and d <= 0 else 0 for d in due]
        if unpriced:
            return ks
        return [1 if k == 0 and seq.steps_without_drafts >= self.probe_every(a * m, batch) else k
                for seq, k, a, m in zip(seqs, ks, alphas, matches)]

    def _price_probe_in(self, seq: Row, alpha: float, match: float, batch: int) -> int | None:
        """With shadow probes: plans until a row's fed probe is due, None if it has none. A row has
        one only where the shadows say its drafts would pay but the measured penalty says no: it
        prices the path again (a cold first step, a changed load), as rarely as its cost allows."""
        if best_drafts(alpha, self.max_drafts, self.costs, self.row_ms, match=match) == 0:
            return None
        return self.probe_every(alpha * match, batch, fed=True) - seq.steps_without_drafts

    def _schedule_shadow(self, seq: Row, estimate: float) -> None:
        at = self.commits + self.probe_every(estimate, 1)
        seq.shadow_at = at
        self._shadow_due.setdefault(at, []).append(seq)

    def on_plain_commit(self, rows: Seq[Row], tokens: Seq[int]) -> bool:
        """A plain decode step's rows and their sampled tokens, before they are appended. Rows whose
        shadow probe is due now: the drafter proposes from the tokens the host has (which end right
        before this one), and the proposal is scored against the token sampled as a one-draft probe
        would have been, fed or not as the device would have fed it. True: a probed row's estimate
        now says drafting pays, so the steady batch should plan again."""
        self.commits += 1
        due = self._shadow_due.pop(self.commits, None)
        if due is None or self.shadow is None:
            return False
        replan = False
        index = {id(seq): i for i, seq in enumerate(rows)}
        for seq in due:
            seq.shadow_at = 0
            i = index.get(id(seq))
            if i is None or seq.finished:  # (out of the batch: scheduled again when it plans without drafts)
                continue
            out, w = seq.output_ids, self.shadow_window
            window = out[-w:] if len(out) >= w else seq.prompt_ids[max(0, len(seq.prompt_ids) + len(out) - w):] + out
            draft, fed = self.shadow(window)
            hit = fed and draft == tokens[i]
            self.shadow_probes += 1
            self.shadow_hits += hit
            self.on_commit(seq, int(fed), 1 + hit, shadow=True)
            a, m = self.alpha(seq), self.match(seq)
            replan |= best_drafts(a, self.max_drafts, self.costs, self.row_ms, self.penalty, m) > 0
            self._schedule_shadow(seq, a * m)
        return replan


    def draft(self, step: DraftStep, planner: Planner) -> None:
        """Set `step.drafts` (k per decode row) and reserve the pages the drafts write. A batch whose
        rows draft is never steady; one whose rows do not may be, until the first probe is due."""
        if step.chunks:
            for seq, work in zip(step.chunk_seqs, step.chunks):
                if work.start_pos == seq.prefix.num_reused > 0:  # the history before a prefix-cache hit's end
                    work.known_before = seq.known_tokens(0, work.start_pos)
            return
        if not step.decode or not all(map(can_speculate, step.decode)):
            return
        if self._steady is not None:  # the steady batch's repeats were steps without drafts too
            steady, began = self._steady
            self._steady = None
            for seq in steady:
                seq.steps_without_drafts += planner.plans - began - 1
        page_size = planner.page_size
        ks = []
        for seq, k in zip(step.decode, self.wanted(step.decode)):
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
            self._pricing = self.timed and self.measured_penalty is None
            planner.batch_changed()
            step.drafts = ks
            writes = planner.pages.take_writes()
            if writes:
                step.page_writes = step.page_writes + writes
        elif self.adaptive and planner.steady_from(step):
            # counted as they pass: a batch that changes sooner leaves its rows' probes where they were
            self._steady = (step.decode, planner.plans)
            n = len(step.decode)
            if self.unpriced(n):  # (plan again as soon as it may draft)
                planner.end_steady_at(1)
            elif self.shadow is not None:
                # it plans again when a shadow probe says drafts pay (on_plain_commit), or a fed probe is due
                due = [d for d in (self._price_probe_in(seq, self.alpha(seq), self.match(seq), n)
                                   for seq in step.decode) if d is not None]
                if due:
                    planner.end_steady_at(max(1, min(due)))
            else:  # the batch repeats without plans until a row's probe is due; the plans it skips count
                planner.end_steady_at(max(1, min(self.probe_every(self.alpha(seq) * self.match(seq), n)
                                                 - seq.steps_without_drafts for seq in step.decode)))

    def on_commit(self, seq: Row, fed: int, emitted: int, shadow: bool = False) -> None:
        """A live row's step planned with drafts fed `fed` of them and emitted `emitted` tokens: its
        match rate, and (if it fed any) its acceptance estimate (`shadow`: a shadow probe, outside the
        counts of drafts fed)."""
        seq.draft_plans = seq.draft_plans * DECAY + 1
        seq.draft_feeds = seq.draft_feeds * DECAY + (fed > 0)
        if not fed:
            return
        accepted = emitted - 1
        seq.drafts_accepted = seq.drafts_accepted * DECAY + accepted
        seq.drafts_tried = seq.drafts_tried * DECAY + accepted + (accepted < fed)
        if shadow:
            return
        self.drafted += fed
        self.accepted += accepted
        self.steps += 1

    def stats(self) -> dict:
        return {"drafted": self.drafted, "accepted": self.accepted, "steps": self.steps,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_length": self.accepted / self.steps if self.steps else 0.0,
                "draft_cost": self.draft_cost, "step_cost_penalty": self.measured_penalty,
                "shadow_probes": self.shadow_probes, "shadow_hits": self.shadow_hits}

"""The Planner's steady batch: the same decode list step after step, pages given at the plan a row
runs out of them, and a full plan as soon as anything changes. Every repeat is also checked against a
full choice of decode rows (SLIPSTREAM_CHECK_INVARIANTS=1, set by conftest.py: Planner._check_steady)."""
import pytest

from slipstream.errors import PipelineInvariantError
from slipstream.runtime.batch import SamplingRow
from slipstream.runtime.runner_api import SampledTokens
from slipstream.scheduler.page_pool import PagePool
from slipstream.scheduler.pipeline import Pipeline
from slipstream.scheduler.planner import Planner
from slipstream.scheduler.sequence import Sequence

PAGE = 4


def _engine(depth=1, pages=64, max_batch=8):
    planner = Planner(PagePool(pages), PAGE, max_batch_size=max_batch, max_step_tokens=64)
    assert planner.check  # (conftest.py)
    pipeline = Pipeline(depth, planner)

    def accept(seqs, tokens, logprobs=None, tops=None):  # the output sink's tick side, as the real one ends by length
        for seq, token in zip(seqs, tokens):
            seq.output_ids.append(token)
            if len(seq.output_ids) >= seq.max_tokens:
                pipeline.finish(seq, "length")

    def step():
        planned = planner.plan(depth)
        planned.step_id = step.n = getattr(step, "n", -1) + 1
        planned.positions = {x.row: x.num_scheduled for x in planned.decode}  # where each row's token lands
        pipeline.on_launch(planned)
        n = len(planned.decode) + sum(w.sample for w in planned.chunks)
        pipeline.on_commit(planned, SampledTokens([7] * n, None), accept)
        return planned

    return planner, step


def _seq(rid, prompt_len, max_tokens):
    return Sequence(rid, list(range(3, 3 + prompt_len)), max_tokens, SamplingRow())


def test_a_steady_batch_is_handed_out_again_with_pages_where_rows_need_them():
    planner, step = _engine()
    seqs = [_seq("a", 3, 12), _seq("b", 5, 12), _seq("c", 2, 6)]
    for s in seqs:
        planner.add(s)
    prefill = step()
    assert prefill.chunks and not prefill.decode
    first = step()  # a full plan: every sequence decodes
    assert first.decode == seqs
    steps = [step() for _ in range(4)]  # c samples its 6th and last token in the 4th
    assert all(s.decode is first.decode for s in steps)  # the same list: the loop relaunches the same input
    for s in [first] + steps:  # a row's page entry is in the step whose token first lands on that page
        writes = {(row, index) for row, index in zip(s.page_writes[::3], s.page_writes[1::3])}
        assert writes == {(row, pos // PAGE) for row, pos in s.positions.items() if pos % PAGE == 0}
    assert seqs[2].finished  # length: the batch changed
    after = step()
    assert after.decode == seqs[:2] and after.decode is not first.decode
    again = step()
    assert again.decode is after.decode


def test_a_row_that_stops_with_a_step_still_in_flight_leaves_the_next_plan():
    """At depth 2 a sequence that stops (EOS, a stop id) is a zombie in the step launched behind it;
    it is not released yet, so the stop itself must end the steady batch."""
    planner = Planner(PagePool(64), PAGE, max_batch_size=8, max_step_tokens=64)
    pipeline = Pipeline(2, planner)
    seqs = [_seq("a", 3, 20), _seq("b", 3, 20)]

    def accept(live, tokens, logprobs=None, tops=None):
        for seq, token in zip(live, tokens):
            seq.output_ids.append(token)
            if seq is seqs[1] and len(seq.output_ids) == 4:
                pipeline.finish(seq, "stop")

    inflight, plans = [], []
    for s in seqs:
        planner.add(s)
    for i in range(8):
        planned = planner.plan(2)
        planned.step_id = i
        pipeline.on_launch(planned)
        plans.append(planned)
        inflight.append(planned)
        if len(inflight) == 2:
            step = inflight.pop(0)
            pipeline.on_commit(step, SampledTokens([7] * len(step.decode) + [7] * len(step.chunks), None), accept)
    assert seqs[1].finished and pipeline.zombie_commits == 1
    assert [len(p.decode) for p in plans[1:]] == [2, 2, 2, 2, 1, 1, 1]


def test_a_request_that_arrives_ends_the_steady_batch():
    planner, step = _engine(depth=2)
    planner.add(_seq("a", 3, 20))
    step()
    steady = step()
    assert step().decode is steady.decode
    planner.add(_seq("late", 2, 4))  # could be admitted: the next plan is a full one
    joined = step()
    assert joined.chunks and joined.decode is not steady.decode


def test_a_repeat_that_would_miss_a_page_is_caught(monkeypatch):
    """The check behind the steady batch: a row listed one plan late would decode a token past its
    pages. (The same holds for a row not listed at all.)"""
    planner, step = _engine()
    planner.add(_seq("a", 3, 20))
    step()
    schedule = Planner._schedule

    def late(self, seq):
        schedule(self, seq)
        due = max(self._due)
        self._due.setdefault(due + 1, []).extend(self._due.pop(due))

    monkeypatch.setattr(Planner, "_schedule", late)
    with pytest.raises(PipelineInvariantError, match="needs a page in a steady step"):
        for _ in range(8):
            step()


def test_the_runner_relaunches_a_steady_input_without_staging_it_again():
    """Through the engine: most decode steps relaunch the input their slot staged (nothing staged,
    chosen or uploaded; page entries alone restaged), and the tokens equal a run that stages every
    step anew. (Mutant: staging every step fails the count.)"""
    import asyncio

    from invariance import invariant_config
    from slipstream import Engine, SamplingParams

    prompts = [[5 + i, 9, 11, 40 + i] for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def run(fresh: bool):
        cfg = invariant_config(model="tiny-random", max_batch_size=4, max_num_batched_tokens=64,
                               kv_cache_tokens=1024, page_size=8)
        async with Engine(cfg) as engine:
            runner = engine._parts.runner
            staged: list[int] = []
            for slot in runner.slots:  # (StepSlot.stage: a slot stages an input it does not hold)
                slot.stage = (lambda stage: lambda *a: staged.append(1) or stage(*a))(slot.stage)
            if fresh:  # the slots forget what they staged before every launch
                launch = runner.launch_forward

                def launch_fresh(*a, **kw):
                    for slot in runner.slots:
                        slot.staged = None
                    return launch(*a, **kw)

                runner.launch_forward = launch_fresh
            outs = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
            return [o.token_ids for o in outs], len(staged), engine.loop.num_steps

    relaunched, stages, steps = asyncio.run(run(fresh=False))
    fresh, fresh_stages, _ = asyncio.run(run(fresh=True))
    assert relaunched == fresh and fresh_stages == steps
    assert stages <= steps // 4, (stages, steps)  # (the fresh run is the mutant: every step staged)


def test_rejected_drafts_of_a_row_left_out_for_samples_end_the_steady_batch():
    """Depth 2, speculation: a row whose drafts count as samples (as if accepted) has none left and is
    left out of the next plan, which (draftless) starts a steady batch; its drafts are rejected at the
    commit, which gives the samples back: the row decodes again, so the commit ends the batch.
    (The draft-model drafter's depth-2 failure, issue 40.)"""
    from slipstream.speculation.policy import Speculation

    planner = Planner(PagePool(64), PAGE, max_batch_size=8, max_step_tokens=64)
    pipeline = Pipeline(2, planner)
    a, b = _seq("a", 3, 4), _seq("b", 3, 20)
    spec = planner.speculation = Speculation(2, adaptive=False)
    spec.wanted = lambda seqs: [2 if seq is a else 0 for seq in seqs]  # only a drafts

    def accept(live, tokens, logprobs=None, tops=None):
        for seq, token in zip(live, tokens):
            seq.output_ids.append(token)
            if len(seq.output_ids) >= seq.max_tokens:
                pipeline.finish(seq, "length")

    def commit(step):  # every draft rejected: a run of one token per row
        runs = [[7] for _ in step.decode] if step.drafts is not None else None
        pipeline.on_commit(step, SampledTokens([7] * (len(step.decode) + len(step.chunks)), None, runs=runs,
                                               fed=step.drafts), accept)

    for s in (a, b):
        planner.add(s)
    inflight, plans, steady = [], [], []
    for i in range(8):
        planned = planner.plan(2)
        planned.step_id = i
        steady.append(planner.steady_from(planned))
        pipeline.on_launch(planned)
        plans.append(planned)
        inflight.append(planned)
        if len(inflight) == 2:
            commit(inflight.pop(0))
    assert plans[1].drafts == [2, 0] and plans[2].decode == [b] and steady[2]
    assert plans[3].decode == [a, b]  # back as soon as its drafts are rejected
    while inflight:
        commit(inflight.pop(0))
    assert a.finished and len(a.output_ids) == 4

"""Speculative decoding in the tick, with the torch-free fake device (tests/fake_runner.py): the
output equals one-token decoding's, token for token, at depth 1 and 2, with EOS inside accepted
runs, length caps, aborts, preemption, prefix caching and failed steps; the referee checks that
every position a speculating step writes has a page and that no registered page is written, with
acceptance decided on the fake device (the host plans as if every draft were accepted)."""
import asyncio

import pytest

from fake_runner import make_prompt
from slipstream.models import ACTIVATION_MODES
from slipstream.runtime.batch import SamplingRow
from slipstream.scheduler.sequence import Sequence
from slipstream.speculation.policy import (FORWARD_MS_BY_ACTIVATIONS, FORWARD_MS_INT8, FORWARD_MS_INT16,
                                           MAX_PROBE_EVERY, PROBE_EVERY, PROBE_SHARE, ROW_MS, Speculation, allocate,
                                           best_drafts, forward_cost)
from test_pipeline_invariants import check_results, request, run_workload

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def speculating(max_drafts, adaptive=False):
    def instrument(loop):
        loop.planner.speculation = Speculation(max_drafts, adaptive)
    return instrument


def test_speculating_rows_emit_runs_and_equal_one_token_decoding():
    reqs = [(make_prompt(6 + s, eos, s), 20, s, None) for s, eos in enumerate((None, 9, 2, None))]
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs, instrument=speculating(4)))
        check_results(reqs, results, loop, pool)
        spec = loop.planner.speculation
        assert spec.steps > 0 and 0 < spec.accepted < spec.drafted  # runs longer than one, and rejections
        assert loop.runner.drafts_accepted >= spec.accepted  # (the host does not count zombies)


def test_eos_inside_an_accepted_run_cuts_it_there():
    # EOS at output 5: with 4 drafts a run covers it; the tokens after it are never appended
    reqs = [(make_prompt(8, 5, 7), 30, 0, None)]
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs, instrument=speculating(4)))
        check_results(reqs, results, loop, pool)
        assert len(results[0][0].token_ids) == 6


def test_adaptive_k_follows_acceptance_and_the_batch():
    assert best_drafts(0.05, 8) == 0  # drafts that are never right cost the forward more than they give
    assert best_drafts(0.95, 8) >= 3
    assert best_drafts(0.6, 8) <= best_drafts(0.9, 8)
    # at batch 8 a position costs more than at batch 1 (measured): fewer drafts pay
    assert allocate([0.6] * 8, 4) == [0] * 8 and best_drafts(0.6, 4) > 0
    assert 0 < sum(allocate([0.9] * 8, 4)) < 8 * best_drafts(0.9, 4)
    assert allocate([0.95, 0.05], 4)[1] == 0  # the drafts go to the row that accepts them
    # int8 / int16 activations: a position costs less at batch 1, so more drafts pay
    assert best_drafts(0.7, 4, FORWARD_MS_INT8) > best_drafts(0.7, 4)
    assert best_drafts(0.7, 4, FORWARD_MS_INT16) > best_drafts(0.7, 4)
    assert set(FORWARD_MS_BY_ACTIVATIONS) == set(ACTIVATION_MODES)  # every mode has its measured costs


def test_a_row_whose_steps_feed_no_drafts_stops_planning_them():
    spec, seq = Speculation(4), Sequence("r", [1, 2, 3], 64, SamplingRow())
    assert spec.match(seq) == 1.0 and best_drafts(spec.alpha(seq), 4) > 0
    misses = 0
    while spec.wanted([seq]) != [0] and misses < 20:  # planned with drafts, the device fed none (a weak match)
        spec.on_commit(seq, 0, 1)
        misses += 1
    assert 2 <= misses <= 12  # (an unfed draft costs only the row's own work: some misses before it stops)
    assert spec.alpha(seq) == 0.5 and spec.steps == 0  # no news of acceptance
    assert allocate([0.9, 0.9], 4, matches=[1.0, 0.1])[1] < allocate([0.9, 0.9], 4)[1]
    low = spec.match(seq)
    spec.on_commit(seq, 2, 3)  # fed and accepted: both estimates rise
    assert spec.match(seq) > low and spec.alpha(seq) > 0.5 and spec.steps == 1


def test_shadow_probes_never_move_the_batch_and_bring_drafts_back():
    """With shadow probes (the n-gram drafter proposes from the host's tokens), a row that does not
    draft is probed on the host at its plain commits: the step stays plain (no one-draft probe moves
    the batch onto the speculating path), and when its proposals start matching the tokens sampled,
    the commit asks for a plan that drafts. The old probe, without shadows, feeds a draft."""
    def rows(n):
        out = []
        for i in range(n):
            seq = Sequence(f"r{i}", [1, 2, 3, 4], 512, SamplingRow())
            seq.drafts_accepted, seq.drafts_tried = 0.0, 12.0  # its drafts were wrong: it drafts none
            seq.steps_without_drafts = 10 * MAX_PROBE_EVERY  # due to probe, however dear
            out.append(seq)
        return out

    old = Speculation(4)
    assert old.wanted(rows(4)).count(1) == 4  # each row due probes with a fed draft: the batch moves
    spec, batch = Speculation(4), rows(4)
    proposed = []
    spec.shadow = lambda tokens: (proposed.append(list(tokens)) or 99, True)
    spec.shadow_window = 3
    assert spec.wanted(batch) == [0] * 4  # no fed probe: the shadows find nothing worth drafting
    assert all(seq.shadow_at > 0 for seq in batch)
    replan, commits = False, 0
    while not replan and commits < 40 * MAX_PROBE_EVERY:
        for seq in batch:
            seq.output_ids.append(7)  # (as `accept` appends, after the commit's policy call)
        replan = spec.on_plain_commit(batch, [99, 99, 99, 99])  # the proposal was the token sampled
        commits += 1
    assert replan and spec.shadow_probes >= 4 and spec.shadow_hits == spec.shadow_probes
    assert all(t == [7, 7, 7] for t in proposed)  # the window: the newest tokens
    assert spec.drafted == 0 and spec.steps == 0  # shadows feed nothing, so they count no drafts
    assert sum(spec.wanted(batch)) > 0  # the estimates say drafts pay again: the plan drafts
    misses = Speculation(4)
    misses.shadow, misses.shadow_window = (lambda tokens: (98, True)), 8
    quiet = rows(2)
    misses.wanted(quiet)
    for _ in range(4 * MAX_PROBE_EVERY):
        assert not misses.on_plain_commit(quiet, [99, 99])  # wrong proposals: never a plan that drafts
    assert misses.shadow_probes >= 2 and misses.shadow_hits == 0 and misses.wanted(quiet) == [0, 0]
    short = Speculation(4)
    short.shadow, short.shadow_window = (lambda tokens: proposed.append(list(tokens)) or (0, True)), 5
    young = rows(1)
    young[0].output_ids = [8, 9]
    short.wanted(young)
    while not short.shadow_probes:
        short.on_plain_commit(young, [0])
    assert proposed[-1] == [2, 3, 4, 8, 9]  # a window reaching into the prompt


def test_a_dear_drafter_drafts_less_and_probes_rarely():
    cheap, dear = Speculation(4), Speculation(4)
    cheap.on_draft_cost(0.01, 1, 5)  # an n-gram lookup: a few percent of the forward
    assert cheap.row_ms == ROW_MS and cheap.probe_every(0.5) == PROBE_EVERY
    dear.on_draft_cost(3.0, 1, 5)  # a draft model recomputing its context: three forwards a proposal
    assert dear.row_ms > 10 * ROW_MS
    assert best_drafts(0.95, 4) > 0 and best_drafts(0.95, 4, row_ms=dear.row_ms) == 0
    # a probe's drafter and position stay within PROBE_SHARE of the plans between probes
    every = dear.probe_every(0.5)
    assert (dear.row_ms + forward_cost(2) - forward_cost(1)) / (every * forward_cost(1)) <= PROBE_SHARE + 1e-9
    assert every > MAX_PROBE_EVERY
    # the estimate follows the drafter: cheap proposals bring the row cost back down
    for _ in range(40):
        dear.on_draft_cost(0.01, 1, 5)
    assert dear.row_ms == ROW_MS


def dear_speculation(max_drafts, spec_factor):
    """Adaptive speculation on a fake device that times its steps: a plain decode step costs what the
    cost table says, a speculating one `spec_factor` times that (on CUDA an eager speculating step
    costs ~8 graphed ones)."""
    def instrument(loop):
        loop.planner.speculation = Speculation(max_drafts, True, timed=True)
        loop.runner.step_cost = lambda rows, positions, speculating: (spec_factor if speculating else 1.0) * \
            forward_cost(positions)
    return instrument


@pytest.mark.parametrize("streams", [1, 3])
def test_a_speculating_step_that_costs_8x_stops_drafting_and_the_batch_stays_plain(streams):
    # the fake's drafter is right two times in three: on the cost table alone (the old policy) a row
    # drafts on most steps; priced by what the device measures, drafts never pay and probes are rare
    reqs = [(make_prompt(6 + s, None, s), 150, 0, None) for s in range(streams)]
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs, instrument=dear_speculation(4, 8.0)))
        check_results(reqs, results, loop, pool)
        runner, spec = loop.runner, loop.planner.speculation
        assert runner.decode_steps >= 140
        # two speculating steps price the path (the first is a warm-up, not counted); at 8x a probe
        # moves the whole batch, due every ~800 plans
        assert runner.speculating_steps == 2, (runner.speculating_steps, runner.decode_steps, spec.stats())
        assert spec.penalty > 4
    # the same device at the table's cost: the policy keeps drafting (the test can tell the two apart)
    results, loop, pool = asyncio.run(run_workload(2, reqs, instrument=dear_speculation(4, 1.0)))
    check_results(reqs, results, loop, pool)
    assert loop.runner.speculating_steps > 20 and loop.planner.speculation.penalty < 1.5


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=8), depth=st.sampled_from([1, 2]),
       num_pages=st.integers(12, 40), max_batch=st.integers(1, 5), step_tokens=st.integers(5, 24),
       device_seed=st.integers(0, 2**16), fail_steps=st.sets(st.integers(0, 40), max_size=3),
       prefix_caching=st.booleans(), max_drafts=st.integers(1, 5), adaptive=st.booleans())
# a row's new holder, mapped onto prefix-cache pages, speculates while its prompt's chunk is still in
# flight: the referee once bounded its writes from the row's previous holder's device position
@example(reqs=[(9, 7, 7, 25, None), (9, None, 7, 25, 0), (26, None, 7, 26, None), (4, 6, 3, 23, None),
               (4, 6, 3, 23, None)], depth=2, num_pages=12, max_batch=4, step_tokens=24, device_seed=3513,
         fail_steps=set(), prefix_caching=True, max_drafts=2, adaptive=True)
def test_speculation_never_changes_the_output(reqs, depth, num_pages, max_batch, step_tokens, device_seed,
                                              fail_steps, prefix_caching, max_drafts, adaptive):
    requests = [(make_prompt(n, eos, salt), mt, arrive, abort) for salt, (n, eos, mt, arrive, abort) in enumerate(reqs)]
    results, loop, pool = asyncio.run(run_workload(depth, requests, num_pages, max_batch, step_tokens, device_seed,
                                                   instrument=speculating(max_drafts, adaptive),
                                                   prefix_caching=prefix_caching, fail_steps=fail_steps))
    check_results(requests, results, loop, pool)
    for seq in (seq for _, seq in results.values()):
        assert seq.drafts_in_flight == 0


# the class of the example above: rows handed from one sequence to the next (aborts, short requests)
# while prompts share pages through the prefix cache, speculating at both depths
shared = st.tuples(st.integers(0, 2), st.integers(0, 28), st.integers(1, 28), st.integers(0, 30),
                   st.none() | st.integers(0, 12))  # (prefix, its length - 4, max_tokens, arrival, abort)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(shared, min_size=2, max_size=8), depth=st.sampled_from([1, 2]), num_pages=st.integers(16, 24),
       max_batch=st.integers(1, 4), step_tokens=st.integers(5, 24), device_seed=st.integers(0, 2**16),
       max_drafts=st.integers(1, 4), adaptive=st.booleans())
@example(reqs=[(0, 0, 1, 0, None), (1, 4, 1, 0, None), (1, 5, 3, 1, None), (0, 0, 1, 0, None)], depth=2,
         num_pages=16, max_batch=1, step_tokens=5, device_seed=0, max_drafts=1, adaptive=False)  # found with 400 examples
def test_speculation_over_shared_prefixes_and_reused_rows(reqs, depth, num_pages, max_batch, step_tokens,
                                                          device_seed, max_drafts, adaptive):
    bases = [make_prompt(32, eos, 100 + b) for b, eos in enumerate((None, 6, 11))]  # EOS by prefix
    requests = [(bases[b][:n + 4], mt, arrive, abort) for b, n, mt, arrive, abort in reqs]
    results, loop, pool = asyncio.run(run_workload(depth, requests, num_pages, max_batch, step_tokens, device_seed,
                                                   instrument=speculating(max_drafts, adaptive),
                                                   prefix_caching=True))
    check_results(requests, results, loop, pool)

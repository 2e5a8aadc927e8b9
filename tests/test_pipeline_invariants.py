"""Scheduler invariants with a torch-free fake device: zombies, refcounts, release, preemption.

Hypothesis drives random prompt lengths, EOS points, max_tokens, arrival times, aborts, pool
sizes and device delays through the real EngineLoop at depth 1 and 2. The fake device completes
work a random number of loop passes late, and its referee fails the run if a page or a row is
handed out while an in-flight step still references it (early release).
"""
import asyncio

import pytest

from fake_clients import ended, serve_requests
from fake_runner import CARRY_MAP, EOS, FakeRunner, NullDetok, RefereedPool, RefereedRows, make_prompt, on_device, reference
from slipstream.errors import EngineClosedError, StepFailedError
from slipstream.outputs import CompletionOutput, RequestMetrics
from slipstream.params import SamplingParams
from slipstream.runtime.batch import SamplingRow
from slipstream.scheduler.engine_loop import EngineLoop
from slipstream.api.output_processor import OutputProcessor, RequestState
from slipstream.scheduler.planner import Planner
from slipstream.scheduler.sequence import PrefixState, Sequence

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PAGE = 4


def make_loop(depth, num_pages=64, max_batch=4, step_tokens=16, seed=0, prefix_caching=False):
    runner = FakeRunner(PAGE, seed=seed)
    pool = RefereedPool(num_pages, runner.referee)
    planner = Planner(pool, PAGE, max_batch, step_tokens, prefix_caching=prefix_caching)
    planner.admission.free_rows = RefereedRows(planner.admission.free_rows, runner.referee)
    return EngineLoop(runner, planner, OutputProcessor(), depth, PAGE), pool


def make_seq(rid, prompt, max_tokens, cache_extra=b"", carry=False):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    req = RequestState(rid, prompt, params, NullDetok(), frozenset({EOS}), RequestMetrics(0.0))
    row = SamplingRow(carry=tuple(CARRY_MAP.items()) if carry else ())
    return Sequence(rid, prompt, max_tokens, row, user=req, prefix=PrefixState(cache_extra))


async def run_workload(depth, requests, num_pages=64, max_batch=4, step_tokens=16, seed=0, instrument=None,
                       prefix_caching=False, fail_steps=()):
    """requests: list of (prompt, max_tokens, arrive_after_yields, abort_after_yields|None[, cache_extra[,
    carry]]); carry: the sequence has the fake's carry tokens (fake_runner.CARRY_MAP).
    fail_steps: step ids whose forward raises on the fake device (their requests fail)."""
    loop, pool = make_loop(depth, num_pages, max_batch, step_tokens, seed, prefix_caching)
    loop.runner.fail_steps = set(fail_steps)
    if instrument is not None:
        instrument(loop)

    def job(i, prompt, max_tokens, arrive, abort_after, cache_extra=b"", carry=False):
        return (lambda: make_seq(f"r{i}", prompt, max_tokens, cache_extra, carry)), arrive, abort_after

    return await serve_requests(loop, [job(i, *r) for i, r in enumerate(requests)]), loop, pool


def check_results(requests, results, loop, pool):
    for i, (prompt, max_tokens, _, abort_after, *_) in enumerate(requests):
        out, seq = results[i]
        want = reference(prompt, max_tokens)
        if isinstance(out, StepFailedError):
            assert loop.failed_steps > 0, f"request {i} failed without an injected fault"
        elif out.finish_reason == "abort":
            assert abort_after is not None
            assert out.token_ids == want[: len(out.token_ids)]  # a prefix: nothing wrong, nothing extra
        else:
            assert out.token_ids == want, f"request {i}"
            assert out.finish_reason == ("stop" if want[-1] == EOS else "length")
        assert seq.inflight_refs == 0 and seq.pending_samples == 0 and not seq.pages and seq.row is None
    assert pool.num_free == pool.total and pool.num_held() == 0, "pages leaked (or a reference left)"
    assert not loop.pipeline.inflight and all(s.owner is None for s in loop.runner.slots)
    assert not loop.planner.running and loop.planner.num_waiting == 0


def test_a_dead_loop_fails_every_waiting_request_and_every_later_one():
    """A bug in the tick (here: the runner raising) kills the loop: requests waiting, running or
    submitted after it get EngineClosedError at once, as on the real engine, instead of hanging."""
    async def go():
        loop, _ = make_loop(2)
        launch = loop.runner.launch_forward

        def broken(step_id, *args, **kwargs):
            if step_id >= 2:
                raise AssertionError("a bug in the tick")
            return launch(step_id, *args, **kwargs)

        loop.runner.launch_forward = broken
        task = asyncio.create_task(loop.run())
        seqs = []
        for i in range(6):
            seqs.append(make_seq(f"r{i}", make_prompt(6, None, i), 8))
            loop.submit(seqs[-1])
            for _ in range(i * 10):
                await asyncio.sleep(0)
        outcomes = await asyncio.wait_for(asyncio.gather(*(ended(seq) for seq in seqs)), 5)
        with pytest.raises(AssertionError, match="a bug"):
            await task
        return outcomes

    outcomes = asyncio.run(go())
    assert all(isinstance(o, EngineClosedError) and isinstance(o.__cause__, AssertionError) for o in outcomes)


def test_zombie_commit_is_skipped_and_pages_released_once():
    """EOS at output 3; at depth 2 the step after it still carries the sequence (a zombie)."""
    prompt = make_prompt(6, eos_at=3, salt=1)
    reqs = [(prompt, 10, 0, None)]
    for depth, zombies in ((1, 0), (2, 1)):
        results, loop, pool = asyncio.run(run_workload(depth, reqs))
        out, seq = results[0]
        assert out.token_ids == reference(prompt, 10) and out.token_ids[-1] == EOS and len(out.token_ids) == 4
        assert loop.pipeline.zombie_commits == zombies
        assert loop.pipeline.released == 1  # PagePool raises on a double free
        check_results(reqs, results, loop, pool)


def test_a_step_already_done_is_committed_before_the_next_launch():
    """Depth 2 launches t+1 before committing t only while t is still running: a step whose tokens
    are on the host already is committed first (an expensive launch must not delay its tokens)."""
    events = []

    def instrument(loop):
        runner = loop.runner
        is_done, launch, read = runner.is_done, runner.launch_forward, runner.read_sampled

        def logged_is_done(step):
            done = is_done(step)
            events.append(("done?", step.step_id, done))
            return done

        async def logged_read(step):
            events.append(("commit", step.step_id))
            return await read(step)

        runner.is_done, runner.read_sampled = logged_is_done, logged_read
        runner.launch_forward = lambda step_id, packed, **kw: events.append(("launch", step_id)) or launch(
            step_id, packed, **kw)

    reqs = [(make_prompt(5 + s, None, s), 12, 3 * s, None) for s in range(6)]
    done = overlapped = 0
    for seed in range(6):  # device delays vary by seed: between them, both cases occur
        events.clear()
        results, loop, pool = asyncio.run(run_workload(2, reqs, seed=seed, instrument=instrument))
        check_results(reqs, results, loop, pool)
        for i, e in enumerate(events):
            if e[0] == "done?" and e[2]:
                done += 1
                assert events[i + 1] == ("commit", e[1])
            elif e[0] == "done?" and events[i + 1][0] == "launch":
                overlapped += 1  # a running step still has the next one launched behind it
    assert done and overlapped


def test_length_cap_makes_no_zombie():
    reqs = [(make_prompt(5, None, s), 7, 0, None) for s in range(3)]
    results, loop, pool = asyncio.run(run_workload(2, reqs))
    assert loop.pipeline.zombie_commits == 0
    check_results(reqs, results, loop, pool)


def test_small_pool_preempts_and_recomputes():
    reqs = [(make_prompt(10, None, s), 12, s, None) for s in range(6)]
    for depth in (1, 2):
        results, loop, pool = asyncio.run(run_workload(depth, reqs, num_pages=12, max_batch=4))
        assert loop.planner.num_preemptions > 0
        check_results(reqs, results, loop, pool)


request = st.tuples(
    st.integers(2, 30),  # prompt length
    st.one_of(st.none(), st.integers(0, 12)),  # EOS position
    st.integers(1, 14),  # max_tokens
    st.integers(0, 40),  # arrival (loop yields)
    st.one_of(st.none(), st.integers(0, 60)),  # abort after (loop yields)
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=10), depth=st.sampled_from([1, 2]),
       num_pages=st.integers(12, 40), max_batch=st.integers(1, 5), step_tokens=st.integers(5, 24),
       device_seed=st.integers(0, 2**16))
def test_random_finish_points_arrivals_and_aborts(reqs, depth, num_pages, max_batch, step_tokens, device_seed):
    requests = [(make_prompt(n, eos, salt), mt, arrive, abort) for salt, (n, eos, mt, arrive, abort) in enumerate(reqs)]
    results, loop, pool = asyncio.run(run_workload(depth, requests, num_pages, max_batch, step_tokens, device_seed))
    check_results(requests, results, loop, pool)
    if depth == 1 and all(r[3] is None for r in requests):
        assert loop.pipeline.zombie_commits == 0  # without aborts, zombies need a step launched ahead


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request, min_size=1, max_size=10), depth=st.sampled_from([1, 2]),
       num_pages=st.integers(12, 40), max_batch=st.integers(1, 5), step_tokens=st.integers(5, 24),
       device_seed=st.integers(0, 2**16), fail_steps=st.sets(st.integers(0, 40), max_size=4),
       prefix_caching=st.booleans())
def test_failed_steps_fail_only_their_requests(reqs, depth, num_pages, max_batch, step_tokens, device_seed,
                                               fail_steps, prefix_caching):
    """A failed step's row-table writes never happen on the device, including the page-table entries
    it carried for sequences that were not in it: those must reach the device with a later step, or
    the survivors read and write K/V through stale entries (wrong tokens, corrupted cached pages)."""
    requests = [(make_prompt(n, eos, salt), mt, arrive, abort) for salt, (n, eos, mt, arrive, abort) in enumerate(reqs)]
    results, loop, pool = asyncio.run(run_workload(depth, requests, num_pages, max_batch, step_tokens, device_seed,
                                                   prefix_caching=prefix_caching, fail_steps=fail_steps))
    check_results(requests, results, loop, pool)


class _DoneAtOnce:
    """A device far ahead of the host: launched work runs at once, so no commit ever waits."""

    def launch(self, fn) -> None:
        on_device(fn)

    def record(self) -> asyncio.Event:
        event = asyncio.Event()
        event.set()
        return event

    def wait(self, event) -> None:
        pass


def test_a_host_bound_loop_still_lets_streams_and_the_output_stage_run():
    """When every step is done before its commit, awaiting it never suspends: the loop must still
    yield each tick, or deltas (and new requests, and HTTP handlers) wait until it idles."""
    async def scenario():
        loop, pool = make_loop(2, max_batch=2)
        loop.runner._streams = (_DoneAtOnce(), _DoneAtOnce())
        task = asyncio.create_task(loop.run())
        seq = make_seq("r0", make_prompt(4, None, 0), 40)
        loop.submit(seq)
        arrivals = []
        while True:
            item = await seq.user.queue.get()
            arrivals.append(loop.num_steps)
            if isinstance(item, CompletionOutput):
                break
        loop.close()
        await task
        return arrivals

    arrivals = asyncio.run(scenario())
    assert len(arrivals) >= 10  # deltas arrived while it generated, not all at the end
    assert arrivals[0] <= 3

"""The standard decode benchmark: blocking (depth 1) vs pipelined (depth 2) in one process.

Workload: N concurrent streams, short prompts, fixed output length L (ignore_eos), greedy. Both
engines are loaded once and kept. Per steady-state step (decode, full batch, engine never idle)
we take medians of the traced step records (slipstream/trace.py): forward, sampling, period,
device idle, host bookkeeping. Observed speedup = wall(depth 1) / wall(depth 2), same tokens.

A repeat is a depth-1 run followed at once by a depth-2 run, and each repeat is predicted from
its own two runs: on shared cores the machine's speed drifts between repeats by more than the
effect measured, so pooling steps of one repeat with the wall of another would compare two
machines. Tables show the repeat with the median observed speedup; --json has every repeat.

Two ways to set depth 2 beside depth 1, kept apart:
- the **prediction** (slipstream/bench_predict.py) is made from the depth-1 run alone, before the
  repeat's depth-2 run starts: T₂ ≈ max(device busy, host time) per step; it can miss;
- the **accounting identity** (`compare`, the seed's cost model): speedup = T_block / T_pipe × (1 − z)
  with both depths' *measured* mean periods. It restates the observed wall ratio in per-step terms
  (it is fed by the run it "predicts"), so its agreement is bookkeeping; it misses only when time
  falls outside the traced steps.
Per step, device idle and period are shown as median, mean and p90: throughput follows the mean.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, cast

from slipstream.api.engine import Engine
from slipstream.bench_predict import Prediction, predict_depth2
from slipstream.outputs import CompletionOutput
from slipstream.params import EngineConfig, SamplingParams

PROMPT_LEN = 8


@dataclass
class StepStats:
    forward_ms: float
    sampling_ms: float
    period_ms: float
    idle_ms: float
    busy_ms: float
    bookkeeping_ms: float
    prefill_period_ms: float  # the first step (all N prompts): its forward → first decode forward
    steps: int
    period_mean_ms: float  # the cost model's T: a wall is a sum of periods, so their mean
    host_split_ms: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # plan, launch, commit, finalize
    period_p90_ms: float = float("nan")
    idle_mean_ms: float = float("nan")
    idle_p90_ms: float = float("nan")
    busy_mean_ms: float = float("nan")
    host_mean_ms: float = float("nan")  # period − commit wait: the host's own time per step


@dataclass
class RunResult:
    depth: int
    streams: int
    output_len: int
    wall: float  # seconds: submission of the N requests → the last one finished
    zombie_rows: int  # zombie commits in the run (0: the planner never runs past max_tokens)
    steady: StepStats

    @property
    def tokens_per_s(self) -> float:
        return self.streams * self.output_len / self.wall


@dataclass
class Comparison:
    streams: int
    output_len: int
    t_block_ms: float
    t_pipe_ms: float
    z: float
    z_zombie: float
    predicted: float  # the accounting identity's speedup factor, e.g. 1.05 (fed by both depths)
    observed: float
    blocking: RunResult = field(repr=False)
    pipelined: RunResult = field(repr=False)
    prediction: Prediction | None = None  # made from `blocking` alone, before `pipelined` ran

    @property
    def prediction_error_pp(self) -> float:
        return 100.0 * (self.prediction.speedup - self.observed) if self.prediction else float("nan")

    @property
    def delta_pp(self) -> float:
        return 100.0 * (self.predicted - self.observed)

    @property
    def period_over_busy(self) -> float:
        """Depth 2 period ÷ (forward + sampling): 1.00 means the bubble is gone."""
        s = self.pipelined.steady
        return s.period_ms / (s.forward_ms + s.sampling_ms)


def _med(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) * 1e3 if xs else float("nan")


def _mean(xs) -> float:
    xs = list(xs)
    return statistics.fmean(xs) * 1e3 if xs else float("nan")


def _p90(xs) -> float:
    xs = sorted(xs)
    if len(xs) < 2:
        return xs[0] * 1e3 if xs else float("nan")
    return statistics.quantiles(xs, n=10, method="inclusive")[8] * 1e3


def steady_state(traces: list, streams: int) -> StepStats:
    """Full-batch decode steps (median, mean, p90); the prefill step is kept apart (the model needs it)."""
    dec = [t for t in traces if t.kind == "decode" and t.num_seqs == streams and t.contiguous]
    pre = [t for t in traces if t.kind == "prefill" and t.num_seqs == streams]
    plan, launch, commit, finalize = (_med(t.host[i] for t in dec) for i in range(4))
    return StepStats(_med(t.forward for t in dec), _med(t.sampling for t in dec), _med(t.period for t in dec),
                     _med(t.idle for t in dec), _med(t.busy for t in dec), _med(t.bookkeeping for t in dec),
                     _med(t.period for t in pre), len(dec), _mean(t.period for t in dec),
                     (plan, launch, commit, finalize),
                     _p90(t.period for t in dec), _mean(t.idle for t in dec), _p90(t.idle for t in dec),
                     _mean(t.busy for t in dec), _mean(t.host_active for t in dec))


async def start_engine(model: str, device: str, depth: int, max_streams: int, output_len: int,
                       dtype: str = "float32", event_wait: str = "auto", speculative=None) -> Engine:
    config = EngineConfig(model=model, device=device, dtype=dtype, pipeline_depth=depth, event_wait=event_wait,
                          speculative=speculative,
                          max_batch_size=max(max_streams, 1),
                          max_num_batched_tokens=max(512, max_streams * PROMPT_LEN),
                          kv_cache_tokens=max(4096, 2 * max_streams * (PROMPT_LEN + output_len + 16)), trace=True)
    engine = await Engine(config).start()
    # warm-up at the largest batch: first-touch allocations must not land in a measured run
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    await asyncio.gather(*(engine.complete(p, warm) for p in prompts(max_streams)))
    return engine


def prompts(streams: int) -> list[list[int]]:
    return [[100 + (7 * i + j) % 400 for j in range(PROMPT_LEN)] for i in range(streams)]


async def run_workload(engine: Engine, streams: int, output_len: int) -> tuple[float, list, int]:
    """One timed run on a started (traced) engine: (wall seconds, step traces, zombie rows)."""
    engine.tracer.clear()
    zombies = engine.loop.pipeline.zombie_commits
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.complete(p, params) for p in prompts(streams)))
    wall = time.perf_counter() - t0
    assert all(len(cast(CompletionOutput, o).token_ids) == output_len for o in outs)  # (n == 1)
    return wall, list(engine.tracer.steps), engine.loop.pipeline.zombie_commits - zombies


def zombie_tax(output_len: int, streams: int, zombie_rows_per_request: float, row_cost: float) -> float:
    """z_zombie: work wasted on sequences that finished while a step containing them was in flight.

    One zombie row per finishing request. Alone (N = 1) that row is a whole wasted step, so the tax
    is 1/L per zombie; in a batch it is one more row in a step that streams the weights anyway, so
    it costs `row_cost` (marginal cost of a row relative to the step) instead. This workload stops
    on max_tokens, which the planner never schedules past: it has no zombies (measured), z = 0.
    """
    per_row = 1.0 if streams == 1 else row_cost
    return zombie_rows_per_request * per_row / output_len


def compare(d1: RunResult, d2: RunResult, row_cost: float = 0.0, prediction: Prediction | None = None) -> Comparison:
    """The accounting identity: depth 2 ÷ depth 1 from both depths' step measurements, never the walls.

    Not a prediction: T_pipe is depth 2's own measured period (see the module docstring).

    A run is one prefill step then L−1 decode steps, so in units of the depth's own step:
        wall_1 ≈ T_block (L − 1 + π₁)        wall_2 ≈ T_pipe (L − 1 + π₂ + β)
    π_d = prefill step period ÷ mean decode period at depth d: the prefill of N prompts is a
    bigger forward, so hiding the same bubble shrinks it less (ideally π₂ > π₁), and π grows
    with N. β = the drain ÷ T_pipe: at depth 2 the last step's copy and commit have no forward
    to hide under; we take the depth-1 bubble (median device idle) as its size. Hence
        1 − z = (1 − z_zombie) × (L − 1 + π₁) / (L − 1 + π₂ + β)
    so z shrinks as 1/L and grows with N through π. Inputs are step measurements only.
    """
    n, length = d1.streams, d1.output_len
    tb, tp = d1.steady.period_mean_ms, d2.steady.period_mean_ms
    pi1, pi2 = d1.steady.prefill_period_ms / tb, d2.steady.prefill_period_ms / tp
    beta = d1.steady.idle_ms / tp
    zz = zombie_tax(length, n, d2.zombie_rows / n, row_cost)
    keep = (1.0 - zz) * (length - 1 + pi1) / (length - 1 + pi2 + beta)
    return Comparison(n, length, tb, tp, 1.0 - keep, zz, tb / tp * keep, d1.wall / d2.wall, d1, d2, prediction)


async def bench(model: str, device: str, streams: list[int], output_len: int, repeats: int,
                on_step=None, on_run=None, dtype: str = "float32", event_wait: str = "auto",
                on_predict=None, speculative=None) -> list[list[Comparison]]:
    """For each stream count, one Comparison per repeat. Within a repeat: depth-1 run, then the
    prediction from it (reported through `on_predict` before anything else happens), then depth 2."""
    engines = {}
    try:
        for depth in (1, 2):
            engines[depth] = await start_engine(model, device, depth, max(streams), output_len, dtype, event_wait,
                                                speculative)
            if on_step is not None:
                engines[depth].loop.observers.append(on_step)
        out = []
        for n in streams:
            reps = []
            for rep in range(repeats):
                runs: dict[int, Any] = {}
                prediction = None
                for depth in (1, 2):
                    if depth == 2:  # committed to before depth 2 runs: it sees the depth-1 run only
                        prediction = predict_depth2(runs[1])
                        if on_predict is not None:
                            on_predict(n, rep, prediction)
                    wall, traces, zombies = await run_workload(engines[depth], n, output_len)
                    runs[depth] = RunResult(depth, n, output_len, wall, zombies, steady_state(traces, n))
                    if on_run is not None:
                        on_run(n, depth, rep, wall, runs[depth].steady)
                reps.append(compare(runs[1], runs[2], prediction=prediction))
            out.append(reps)
        return out
    finally:
        for e in engines.values():
            await e.close()


def representative(reps: list[Comparison]) -> Comparison:
    """The repeat with the median observed speedup (chosen by the observation alone)."""
    return sorted(reps, key=lambda c: c.observed)[(len(reps) - 1) // 2]

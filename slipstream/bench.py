"""The standard decode benchmark: blocking (depth 1) vs pipelined (depth 2) in one process.

Workload: N concurrent streams, short prompts, fixed output length L (ignore_eos), greedy. Per
steady-state step (full batch, decode only) we report medians of:
  forward     device time of the forward (compute stream span)
  sampling    device time of sampling + the device→host copy
  period      start of forward t → start of forward t+1
  idle        period − forward − sampling: the bubble
  host        plan + launch + commit + finalize on the event loop (excluding waits)
and the wall-clock throughput of the whole run; speedup = tokens/s at depth 2 ÷ depth 1.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass

from slipstream.api.engine import Engine
from slipstream.params import EngineConfig, SamplingParams


@dataclass
class StepStats:
    forward_ms: float
    sampling_ms: float
    period_ms: float
    idle_ms: float
    host_ms: float
    plan_ms: float
    launch_ms: float
    commit_ms: float
    finalize_ms: float
    steps: int


@dataclass
class RunResult:
    model: str
    depth: int
    streams: int
    output_len: int
    wall_s: float
    tokens_per_s: float
    steady: StepStats


def _median(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3 if xs else float("nan")


def steady_state(loop, streams: int) -> StepStats:
    """Pair each step with its device spans (FIFO order per stream) and keep full decode steps."""
    fwd = [s for s in loop.device_spans if s[1] == "forward"]
    smp = [s for s in loop.device_spans if s[1] == "sample"]
    d2h = [s for s in loop.device_spans if s[1] == "d2h"]
    recs = sorted(loop.records, key=lambda r: r.step_id)
    rows = {k: [] for k in ("forward", "sampling", "period", "idle", "host", "plan", "launch", "commit", "finalize")}
    for r in recs[:-1]:
        k = r.step_id
        if r.kind != "decode" or r.num_seqs != streams or k + 1 >= len(fwd):
            continue
        forward = fwd[k][3] - fwd[k][2]
        sampling = (smp[k][3] - smp[k][2]) + (d2h[k][3] - d2h[k][2])
        period = fwd[k + 1][2] - fwd[k][2]
        rows["forward"].append(forward)
        rows["sampling"].append(sampling)
        rows["period"].append(period)
        rows["idle"].append(max(period - forward - (smp[k][3] - smp[k][2]), 0.0))
        rows["host"].append(r.plan + r.launch + r.commit + r.finalize)
        for name in ("plan", "launch", "commit", "finalize"):
            rows[name].append(getattr(r, name))
    return StepStats(**{f"{k}_ms": _median(v) for k, v in rows.items()}, steps=len(rows["period"]))


async def run_once(model: str, device: str, depth: int, streams: int, output_len: int, prompt_len: int = 8,
                   **engine_kw) -> RunResult:
    config = EngineConfig(model=model, device=device, pipeline_depth=depth, max_batch_size=max(streams, 1),
                          max_num_batched_tokens=max(512, streams * prompt_len), trace=True, **engine_kw)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    async with Engine(config) as engine:
        await engine.complete([100 + i for i in range(prompt_len)], SamplingParams(max_tokens=4, temperature=0.0))
        loop = engine.loop
        loop.records.clear()
        loop.device_spans.clear()
        first_step = loop.num_steps
        prompts = [[100 + (7 * i + j) % 400 for j in range(prompt_len)] for i in range(streams)]
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.complete(p, params) for p in prompts))
        wall = time.perf_counter() - t0
        assert all(len(o.token_ids) == output_len for o in outs)
        for r in loop.records:
            r.step_id -= first_step
        stats = steady_state(loop, streams)
    return RunResult(model, depth, streams, output_len, wall, streams * output_len / wall, stats)


def predicted_speedup(blocking_ms: float, pipelined_ms: float, streams: int, output_len: int,
                      zombie_row_cost: float) -> float:
    """Photon's model: T_block / T_pipe × (1 − z).

    z, the zombie tax: at depth 2 every sequence that stops on EOS/stop costs one extra row in one
    step. With one stream that row is a whole wasted forward every L tokens (z = 1 / L); with N
    streams it is one row among N in a step whose cost is mostly weights, so z = zombie_row_cost / L
    where zombie_row_cost is the marginal cost of one row relative to a step (measured: forward at
    N+1 vs N, divided by the forward at N). Runs with ignore_eos have no zombies: pass 0.
    """
    z = zombie_row_cost / output_len if streams > 1 else (1.0 / output_len if zombie_row_cost else 0.0)
    return blocking_ms / pipelined_ms * (1.0 - z)


def format_table(results: list[RunResult]) -> str:
    by = {(r.model, r.streams, r.depth): r for r in results}
    lines = [
        "| model | streams | L | depth | forward ms | sampling ms | period ms | device idle ms | host ms "
        "(plan/launch/commit/finalize) | tokens/s | speedup d2/d1 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in results:
        s = r.steady
        base = by.get((r.model, r.streams, 1))
        speed = f"{r.tokens_per_s / base.tokens_per_s:.3f}" if base and r.depth == 2 else ""
        lines.append(
            f"| {r.model} | {r.streams} | {r.output_len} | {r.depth} | {s.forward_ms:.2f} | {s.sampling_ms:.2f} | "
            f"{s.period_ms:.2f} | {s.idle_ms:.2f} | {s.host_ms:.2f} ({s.plan_ms:.2f}/{s.launch_ms:.2f}/"
            f"{s.commit_ms:.2f}/{s.finalize_ms:.2f}) | {r.tokens_per_s:.1f} | {speed} |")
    return "\n".join(lines)


def to_json(results: list[RunResult]) -> list[dict]:
    return [asdict(r) for r in results]

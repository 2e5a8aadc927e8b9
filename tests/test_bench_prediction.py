"""The independent prediction of `slipstream bench`: made from the depth-1 run alone, before depth 2."""
from __future__ import annotations

import math

import pytest

import slipstream.bench as bench_mod
from slipstream.bench import RunResult, StepStats
from slipstream.bench_predict import disagreement, predict_depth2
from slipstream.bench_report import CPU_NOTE, format_tables


def _run(depth: int, period: float, busy: float, host: float, wall: float, length: int = 101) -> RunResult:
    steady = StepStats(0, 0, period, 0, busy, 0, period, length - 1, period,
                       busy_mean_ms=busy, host_mean_ms=host, idle_mean_ms=period - busy)
    return RunResult(depth, 8, length, wall, 0, steady)


def test_prediction_is_the_slower_lane_and_rescales_only_decode_steps():
    # host-bound: 3 ms of host against 2 ms of device; 100 decode steps each lose 5 − 3 = 2 ms
    p = predict_depth2(_run(1, period=5.0, busy=2.0, host=3.0, wall=1.0))
    assert p.period_ms == pytest.approx(3.0) and p.bound == "host"
    assert p.wall_s == pytest.approx(0.8) and p.speedup == pytest.approx(1.25)
    # device-bound: the period falls to the device's busy time
    p = predict_depth2(_run(1, period=5.0, busy=4.0, host=1.0, wall=1.0))
    assert p.period_ms == pytest.approx(4.0) and p.bound == "device" and p.speedup == pytest.approx(1 / 0.9)
    # no bubble at depth 1 (period = busy): nothing to win
    assert predict_depth2(_run(1, period=4.0, busy=4.0, host=1.0, wall=1.0)).speedup == pytest.approx(1.0)


def test_prediction_refuses_anything_but_the_depth1_run():
    with pytest.raises(ValueError, match="depth-1"):
        predict_depth2(_run(2, period=5.0, busy=2.0, host=3.0, wall=1.0))


async def test_bench_predicts_before_depth2_runs_from_depth1_only(monkeypatch):
    events: list = []
    real_run, real_predict = bench_mod.run_workload, bench_mod.predict_depth2

    async def run_workload(engine, streams, output_len):
        events.append(("run", engine.config.pipeline_depth))
        return await real_run(engine, streams, output_len)

    def predict(depth1):
        events.append(("predict", depth1.depth))
        return real_predict(depth1)

    monkeypatch.setattr(bench_mod, "run_workload", run_workload)
    monkeypatch.setattr(bench_mod, "predict_depth2", predict)
    announced = []
    (reps,) = await bench_mod.bench("tiny-random", "cpu", [2], 8, 2,
                                    on_predict=lambda n, rep, p: announced.append((p, list(events))))
    # per repeat: depth 1 runs, the prediction is made from it, only then depth 2 runs
    assert events == [("run", 1), ("predict", 1), ("run", 2)] * 2
    for c, (p, seen) in zip(reps, announced):
        assert c.prediction is p and seen[-1] == ("predict", 1) and seen.count(("run", 2)) < len(reps)
        assert p == real_predict(c.blocking)  # a function of the depth-1 run alone
        assert math.isfinite(p.speedup) and math.isfinite(c.prediction_error_pp)
    # on the CPU the tables say that depth 2's gain is within noise there (before any repeats-disagree warning)
    cpu, gpu = format_tables([reps], device="cpu"), format_tables([reps], device="cuda")
    assert CPU_NOTE in cpu and CPU_NOTE not in gpu
    assert cpu.index(CPU_NOTE) < cpu.index("WARNING") if "WARNING" in cpu else True


def test_disagreement_warns_only_when_the_spread_exceeds_the_effect():
    assert disagreement([1.05]) is None
    assert disagreement([1.24, 1.25, 1.26]) is None  # spread 2 pp, effect 25%
    msg = disagreement([0.97, 1.05, 1.21])  # spread 24 pp, effect 5%
    assert msg and "wider than the effect" in msg and "+5.0%" in msg


def test_steady_state_reports_the_mean_idle_a_median_hides():
    from slipstream.trace import StepTrace

    def step(k, period_ms, idle_ms, kind="decode"):
        p, i = period_ms / 1e3, idle_ms / 1e3
        return StepTrace(k, kind, 4, 4, float(k), p, p - i, 0.0, p - i, i, 0.0, True, commit_wait=p / 2)

    idles = [0.0] * 9 + [4.0]  # nine steps without a bubble, one with a 4 ms one
    traces = [step(0, 20.0, 0.0, "prefill")] + [step(k + 1, 2.0 + i, i) for k, i in enumerate(idles)]
    s = bench_mod.steady_state(traces, 4)
    assert s.steps == 10 and s.idle_ms == 0.0  # the median says: no bubble
    assert s.idle_mean_ms == pytest.approx(0.4) and s.period_mean_ms == pytest.approx(2.4)
    assert s.idle_p90_ms == pytest.approx(0.4) and s.period_p90_ms == pytest.approx(2.4)  # inclusive p90
    assert s.host_mean_ms == pytest.approx(1.2) and s.busy_mean_ms == pytest.approx(2.0)
    assert s.prefill_period_ms == pytest.approx(20.0)

"""Tables and JSON of `slipstream bench` (slipstream/bench.py measures; this file only formats).

(a) per step: median, mean and p90 of period and device idle (throughput follows the mean);
(b) the independent prediction, made from the depth-1 run before depth 2 ran, against what depth 2
    measured; (c) the accounting identity (both depths' measured periods; bookkeeping, not a
    prediction). A warning line follows any stream count whose repeats spread wider than the effect.
"""
from __future__ import annotations

from dataclasses import asdict

from slipstream.bench import Comparison, RunResult, representative
from slipstream.bench_predict import disagreement


def _pct(x: float) -> str:
    return f"{100 * (x - 1):+.1f}%"


def _three(med: float, mean: float, p90: float) -> str:
    return f"{med:.2f} / {mean:.2f} / {p90:.2f}"


def warnings(results: list[list[Comparison]]) -> list[str]:
    out = []
    for reps in results:
        msg = disagreement([c.observed for c in reps])
        if msg:
            out.append(f"WARNING streams={reps[0].streams}: {msg}")
    return out


CPU_NOTE = ("On the CPU there is no device to keep busy while the host works: the forward and the engine loop "
            "share the same cores, so depth 2's gain here is within the repeats' noise (a few percent either way; "
            "docs/benchmarks.md). What depth 2 wins is measured on a GPU: docs/results/h100-2026-11-27/.")


def notes(results: list[list[Comparison]], device: str) -> list[str]:
    """What the tables' numbers mean on this device, then any repeats-disagree warnings."""
    return ([CPU_NOTE] if device == "cpu" else []) + warnings(results)


def format_tables(results: list[list[Comparison]], device: str = "cuda") -> str:
    rows = [representative(reps) for reps in results]
    a = ["(a) per step, steady state (ms); period and device idle as median / mean / p90", "",
         "| streams | depth | forward | sampling | period | device idle | busy (mean) | host (mean) "
         "| bookkeeping (plan/launch/commit/finalize) | period ÷ (fwd+smp) |",
         "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in rows:
        for r in (c.blocking, c.pipelined):
            s = r.steady
            a.append(f"| {c.streams} | {r.depth} | {s.forward_ms:.2f} | {s.sampling_ms:.2f} | "
                     f"{_three(s.period_ms, s.period_mean_ms, s.period_p90_ms)} | "
                     f"{_three(s.idle_ms, s.idle_mean_ms, s.idle_p90_ms)} | {s.busy_mean_ms:.2f} | "
                     f"{s.host_mean_ms:.2f} | {s.bookkeeping_ms:.2f} "
                     f"({'/'.join(f'{x:.2f}' for x in s.host_split_ms)}) | "
                     f"{s.period_ms / (s.forward_ms + s.sampling_ms):.3f} |")
    b = ["(b) prediction from the depth-1 run alone, made before depth 2 ran: "
         "T₂ = max(busy, host) per step; wall₂ = wall₁ − (L − 1)(T₁ − T₂)", "",
         "| streams | depth-1 busy | depth-1 host | bound | predicted T₂ | measured T₂ (mean) | T₂ error "
         "| predicted speedup | observed | error (pp) | error, every repeat |",
         "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for c, reps in zip(rows, results):
        p = c.prediction
        assert p is not None  # (every row of this table has one)
        every = " ".join(f"{r.prediction_error_pp:+.1f}" for r in reps)
        measured = c.pipelined.steady.period_mean_ms
        b.append(f"| {c.streams} | {p.busy_ms:.2f} | {p.host_ms:.2f} | {p.bound} | {p.period_ms:.2f} | "
                 f"{measured:.2f} | {100 * (p.period_ms / measured - 1):+.1f}% | {_pct(p.speedup)} | "
                 f"{_pct(c.observed)} | {c.prediction_error_pp:+.1f} | {every} |")
    b += ["", "busy: device busy per step; host: period − commit wait per step (the host's own time); "
          "both means over depth-1 steady-state steps. error = predicted − observed"]
    d = ["(c) accounting identity, not a prediction: T_block / T_pipe × (1 − z) with both depths' measured "
         "mean periods; it restates the wall ratio, so agreement is bookkeeping", "",
         "| streams | T_block (ms) | T_pipe (ms) | L | z | identity | observed | Δ (pp) | Δ, every repeat |",
         "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c, reps in zip(rows, results):
        every = " ".join(f"{r.delta_pp:+.1f}" for r in reps)
        d.append(f"| {c.streams} | {c.t_block_ms:.2f} | {c.t_pipe_ms:.2f} | {c.output_len} | {100 * c.z:.2f}% | "
                 f"{_pct(c.predicted)} | {_pct(c.observed)} | {c.delta_pp:+.1f} | {every} |")
    d += ["", "z: the running-ahead tax from L and N (prefill share, last step's drain, zombies); "
          "a large Δ means time fell outside the traced steps"]
    tail = ["Rows show the repeat with the median observed speedup."] + notes(results, device)
    return "\n".join(a + [""] + b + [""] + d + [""] + tail)


def to_json(results: list[list[Comparison]], meta: dict) -> dict:
    def run(r: RunResult) -> dict:
        return {**asdict(r), "tokens_per_s": r.tokens_per_s}

    def row(c: Comparison) -> dict:
        return {"t_block_ms": c.t_block_ms, "t_pipe_ms": c.t_pipe_ms, "z": c.z, "z_zombie": c.z_zombie,
                "identity_speedup": c.predicted, "observed_speedup": c.observed, "identity_delta_pp": c.delta_pp,
                "prediction": asdict(c.prediction) if c.prediction else None,
                "prediction_error_pp": c.prediction_error_pp,
                "period_over_forward_plus_sampling": c.period_over_busy, "depth1": run(c.blocking),
                "depth2": run(c.pipelined)}

    return {**meta, "results": [{"streams": reps[0].streams, "output_len": reps[0].output_len,
                                 **row(representative(reps)), "repeats": [row(c) for c in reps],
                                 "warning": disagreement([c.observed for c in reps])} for reps in results]}

"""The host-only benchmark (tools/bench/bench_host.py) at tiny N: it drives the real engine with a null model,
selects exactly the steady decode steps and prints the table and the fit."""
import importlib.util
import json
import math
import os
import sys

_spec = importlib.util.spec_from_file_location("bench_host", os.path.join(os.path.dirname(__file__), "..", "tools",
                                                                            "bench", "bench_host.py"))
bench_host = importlib.util.module_from_spec(_spec)
sys.modules["bench_host"] = bench_host
_spec.loader.exec_module(bench_host)


def test_fit_line_recovers_a_line():
    a, b = bench_host.fit_line([1, 8, 32, 128], [100 + 30 * n for n in (1, 8, 32, 128)])
    assert math.isclose(a, 100) and math.isclose(b, 30)


def test_steady_keeps_only_full_decode_steps_between_full_decode_steps():
    rec = bench_host.StepRecord
    seqs = [4, 4, 4, 4, 3, 4, 4, 4]  # step 4 is partial (a sequence finished): it breaks the run
    kinds = ["prefill"] + ["decode"] * 7
    records = [rec(i, k, n, 10.0 * i * i, 1.0 * i * i, 0.5 * i, {}, 3 * i) for i, (k, n) in enumerate(zip(kinds, seqs))]
    got = [(r.step_id, *times) for r, *times in bench_host.steady(records, 4)]
    assert got == [(2, 40.0 - 10.0, 4.0 - 1.0, 0.5, 3), (6, 360.0 - 250.0, 36.0 - 25.0, 0.5, 3)]
    records += [rec(i, "decode", 4, 10.0 * i * i, 1.0 * i * i, 0.5 * i, {}) for i in (8, 9)]
    assert [r.step_id for r, *_ in bench_host.steady(records, 4)] == [2, 6, 7, 8]
    del records[7]  # a step the observer never saw: the intervals around it span two steps
    assert [r.step_id for r, *_ in bench_host.steady(records, 4)] == [2]


def test_runs_the_real_engine_and_prints_table_and_fit(tmp_path, capsys):
    from slipstream.api import assemble

    real = assemble.build_model
    out = tmp_path / "host.json"
    length = 12
    rc = bench_host.main(["--streams", "1", "4", "--repeats", "1", "--len", str(length), "--quiet",
                          "--json-out", str(out)])
    assert rc == 0
    assert assemble.build_model is real  # the seam is restored
    text = capsys.readouterr().out
    assert "| 1 | 9 |" in text and "| 4 | 9 |" in text  # L − 3 steady steps per run: prefill, first, last out
    assert text.count("slope") == 4 and "intercept" in text
    assert "| N | plan | launch | commit | finalize |" in text  # the loop exposes its phase timings
    assert ("| N | CPU µs / token | loop-thread CPU µs / token | passes / step median | passes / step mean "
            "| passes / step p90 | passes / step (run) | tokens / delta |") in text
    doc = json.loads(out.read_text())
    assert doc["git_commit"] and "git_dirty" in doc and doc["torch"]
    assert [r["streams"] for r in doc["results"]] == [1, 4]
    for r in doc["results"]:
        assert len(r["step_us"]) == len(r["cpu_us"]) == len(r["loop_cpu_us"]) == len(r["passes"]) == length - 3
        assert all(x > 0 for x in r["step_us"]) and all(len(v) == length - 3 for v in r["phase_us"].values())
        res = bench_host.NResult(r["streams"], runs=r["runs"])
        (run,) = r["runs"]  # one repeat
        assert run["tokens"] == r["streams"] * length and run["steps"] >= length
        # per-token CPU × tokens is the run's CPU time; the loop thread's is part of the process's
        assert math.isclose(res.per_run("cpu_per_token_us")[0] * run["tokens"], run["cpu_s"] * 1e6)
        assert 0 < run["loop_cpu_s"] <= run["cpu_s"] * 1.01
        # every token reached its stream in some delta and some pass: at most one of each per token
        assert r["streams"] <= run["deltas"] <= run["tokens"] and r["streams"] <= run["passes"] <= run["tokens"]
        assert res.per_run("tokens_per_delta")[0] >= 1 and res.per_run("passes_per_step")[0] > 0
        assert 0 <= min(r["passes"]) and max(r["passes"]) <= r["streams"] * 2  # a pass per request, few steps
        row = next(line for line in text.split("whole runs and the output stage")[1].splitlines()
                   if line.startswith(f"| {r['streams']} | "))
        assert row.split("|")[7].strip() == f"{res.per_run('passes_per_step')[0]:.1f}"
    for intercept, slope in doc["fits"].values():
        assert math.isfinite(intercept) and math.isfinite(slope)


def test_null_model_logits_have_distinct_letters_per_row():
    import torch

    from slipstream.models.config import tiny_config

    model = bench_host.NullModel(tiny_config(), max_rows=30, device=torch.device("cpu"))

    class Batch:
        sample_indices = torch.zeros(27, dtype=torch.int64)

    ids = model(Batch(), None).argmax(-1)
    assert ids.shape == (27,)
    assert bytes((ids - 3).tolist()).decode() == "abcdefghijklmnopqrstuvwxyz" + "a"

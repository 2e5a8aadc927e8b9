"""The CPU forward's thread count is measured on this machine once and then read back."""
import json

import torch

from slipstream import EngineConfig
from slipstream.api.assemble import assemble
from slipstream.models.loading.build import build_model
from slipstream.runtime.devices import cpu_threads


def test_choice_needs_a_clear_win():
    assert cpu_threads.choose({1: 10.0, 2: 9.5}) == 1  # within 10%: the fewer threads
    assert cpu_threads.choose({1: 10.0, 2: 8.0}) == 2
    assert cpu_threads.choose({1: 10.0, 2: 20.0, 4: 30.0}) == 1
    assert cpu_threads.choose({1: 10.0, 2: 8.9, 4: 7.0}) == 4
    assert cpu_threads.candidates(1) == [1] and cpu_threads.candidates(2) == [1, 2]
    assert cpu_threads.candidates(6) == [1, 2, 4, 6]


def test_measured_once_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path))
    model, _, _ = build_model("tiny-random", "float32", torch.device("cpu"))
    calls = []
    real = cpu_threads.time_decode_step

    def counting(m, threads, repeats=cpu_threads.REPEATS):
        calls.append(threads)
        return real(m, threads, repeats=2)

    monkeypatch.setattr(cpu_threads, "time_decode_step", counting)
    before = torch.get_num_threads()
    try:
        first = cpu_threads.forward_threads(model, 2)
        assert calls == [[1, 2]]
        record = json.loads(next((tmp_path / "kernels").glob("threads-*.json")).read_text())
        assert record["threads"] == first and set(record["median_ms"]) == {"1", "2"}
        assert cpu_threads.forward_threads(model, 2) == first and len(calls) == 1  # read back
        monkeypatch.setenv("SLIPSTREAM_RECALIBRATE", "1")
        cpu_threads.forward_threads(model, 2)
        assert len(calls) == 2
        monkeypatch.delenv("SLIPSTREAM_RECALIBRATE")
        next((tmp_path / "kernels").glob("threads-*.json")).write_text("{broken")
        cpu_threads.forward_threads(model, 2)
        assert len(calls) == 3  # a damaged record is measured again
        assert cpu_threads.forward_threads(model, 1) == 1 and len(calls) == 3  # one thread: nothing to measure
    finally:
        torch.set_num_threads(before)


def test_engine_takes_the_recorded_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_threads, "time_decode_step",
                        lambda model, threads, repeats=0: {n: 10.0 / n for n in threads})
    parts = assemble(EngineConfig(model="tiny-random", kv_cache_tokens=256))
    try:
        ceiling = torch.get_num_threads()
        assert parts.runner.model.backend == "cpu"
        assert parts.device.forward_threads == max(cpu_threads.candidates(ceiling))  # each doubling won here
    finally:
        parts.close()

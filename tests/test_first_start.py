"""A first start says what its slow phases cost, one line each, only from the CLI (configure_logging
above "info"); a second start, with everything cached, says nothing; a library user sees nothing."""
import shutil

import pytest
import torch
from test_weight_cache import gguf_file  # noqa: F401 - the fixture

from slipstream.logging_setup import configure_logging, first_start_phase, reset_logging
from slipstream.models.kernels import cpu_kernels
from slipstream.models.loading import loader
from slipstream.models.loading.build import build_model
from slipstream.runtime.devices import cpu_threads


@pytest.fixture(autouse=True)
def library_default():
    reset_logging()  # (an earlier test's CLI run leaves logging configured: this file starts from a library's)
    yield
    reset_logging()


@pytest.fixture
def cli_logging():
    configure_logging("warning")
    yield
    reset_logging()


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_WEIGHT_CACHE", "1")
    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def phase_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("slipstream: ") and " in " in line]


def test_the_line_only_for_the_cli_above_info(capsys):
    first_start_phase("compiled x", 1.25)  # library default: nothing
    configure_logging("info")  # the phase's own event says it at info
    first_start_phase("compiled x", 1.25)
    assert capsys.readouterr().err == ""
    configure_logging("warning")
    try:
        first_start_phase("compiled x", 1.25, cached_in="/c/x.so")
    finally:
        reset_logging()
    assert capsys.readouterr().err == "slipstream: compiled x in 1.2 s (once: later starts reuse /c/x.so)\n"
    first_start_phase("compiled x", 1.25)  # reset: the library default again
    assert capsys.readouterr().err == ""


def test_converting_a_gguf_is_one_line_then_none(gguf_file, empty_cache, cli_logging, capsys):  # noqa: F811
    loader._load_gguf_cached(gguf_file)
    lines = phase_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"converted {gguf_file.name} into the weight cache in " in lines[0], lines
    loader._load_gguf_cached(gguf_file)  # second start: the entry is mapped back
    assert phase_lines(capsys.readouterr().err) == []


def test_compiling_the_kernels_is_one_line_then_none(tmp_path, cli_logging, capsys, monkeypatch):
    cpu_kernels.native_kernels.cache_clear()
    real = cpu_kernels.native_kernels()  # the suite's own build (compiled once, shared with other tests)
    if real is None:
        pytest.skip("no compiled CPU kernels here")
    built = real._name

    def copy(cc, out):  # the compile, without paying for it again: a copy of the same build
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(built, out)
        return 0.5

    monkeypatch.setattr(cpu_kernels, "compile_library", copy)
    capsys.readouterr()
    try:
        monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "empty"))
        cpu_kernels.native_kernels.cache_clear()
        assert cpu_kernels.native_kernels() is not None
        assert phase_lines(capsys.readouterr().err) == [
            "slipstream: compiled the CPU kernels for this machine in 0.5 s (once: later starts reuse "
            f"{cpu_kernels.library_path(cpu_kernels._compiler())})"]
        cpu_kernels.native_kernels.cache_clear()
        assert cpu_kernels.native_kernels() is not None  # second start: loaded, not compiled
        assert phase_lines(capsys.readouterr().err) == []
    finally:
        cpu_kernels.native_kernels.cache_clear()


def test_measuring_the_threads_is_one_line_then_none(empty_cache, cli_logging, capsys, monkeypatch):
    model, _, _ = build_model("tiny-random", "float32", torch.device("cpu"))
    monkeypatch.setattr(cpu_threads, "time_decode_step", lambda m, threads: {n: 1.0 for n in threads})
    before = torch.get_num_threads()
    try:
        cpu_threads.forward_threads(model, 2)
        lines = phase_lines(capsys.readouterr().err)
        assert len(lines) == 1 and "measured the CPU forward's thread count (1 of 2)" in lines[0], lines
        cpu_threads.forward_threads(model, 2)
        assert phase_lines(capsys.readouterr().err) == []
    finally:
        torch.set_num_threads(before)

"""tools/profile/step_trace.py runs on the real engine (null model) and counts one steady decode step; the
count is held to issue 36's bound, so the step's path stays short."""
import importlib.util
import os
import re
import sys

_spec = importlib.util.spec_from_file_location("step_trace", os.path.join(os.path.dirname(__file__), "..", "tools",
                                                                            "profile", "step_trace.py"))
step_trace = importlib.util.module_from_spec(_spec)
sys.modules["step_trace"] = step_trace
_spec.loader.exec_module(step_trace)

# what one steady decode step may cross: the tick, the output stage and the stream consumers on the
# loop, and the CPU device's side (issue 36: <= 12 files, <= 60 functions, from 27 / 110 at 99596d0)
MAX_FILES, MAX_FUNCTIONS = 12, 60
# the code of images, the carry and prefix caching: none of it runs on a text step that has none
NOT_ON_A_TEXT_STEP = ("scheduler/encoder_cache.py", "scheduler/encoder_budget.py", "runtime/step/encoder_launch.py",
                      "runtime/step/carry.py", "scheduler/prefix_cache.py", "scheduler/block_hash.py", "images.py")


def _median(text):
    files, functions, calls, python, depth = map(int, re.search(
        r"median: (\d+) files, (\d+) functions, (\d+) slipstream calls \((\d+) Python calls\), (\d+) slipstream "
        r"frames deep", text).groups())
    return files, functions, calls, python, depth


def test_a_steady_step_crosses_at_most_twelve_files_and_sixty_functions(capsys, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CHECK_INVARIANTS", "0")  # the engine as it runs, not with the tests' checks
    assert step_trace.main(["--streams", "2", "--ticks", "3", "--len", "14", "--no-header"]) == 0
    text = capsys.readouterr().out
    files, functions, calls, python, depth = _median(text)
    assert 0 < files <= functions <= calls <= python and depth >= 2
    assert files <= MAX_FILES and functions <= MAX_FUNCTIONS, text
    listed = re.findall(r"^  slipstream/(\S+): \d+ / \d+", text, re.M)
    assert len(listed) == files and "runtime/devices/cpu_device.py" in listed  # the device's threads are traced too
    assert not set(listed) & set(NOT_ON_A_TEXT_STEP), listed
    assert sys.getprofile() is None  # the hook is off again
    assert "  slipstream/params.py: " in text  # the sampling path starts at SamplingParams


def test_the_tick_scope_starts_at_the_tick(capsys):
    assert step_trace.main(["--streams", "2", "--ticks", "1", "--len", "12", "--no-header", "--scope", "tick"]) == 0
    text = capsys.readouterr().out
    assert "slipstream/scheduler/engine_loop.py:EngineLoop.tick" in text  # the deepest chain starts at the tick
    assert _median(text)[0] < 12


def test_a_speculating_step_is_traced_and_its_files_counted(capsys):
    """--drafts traces a steady speculating step instead (issue 53 reports its count; no cap: a
    speculating batch plans in full every step)."""
    assert step_trace.main(["--streams", "2", "--ticks", "1", "--len", "12", "--no-header", "--drafts", "2"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("one steady speculating (2 n-gram drafts a row) step")
    listed = re.findall(r"^  slipstream/(\S+): \d+ / \d+", text, re.M)
    assert "speculation/runner.py" in listed and "speculation/policy.py" in listed
    assert len(listed) == _median(text)[0] > 12

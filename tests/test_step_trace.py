"""tools/step_trace.py runs on the real engine (null model) and counts one steady decode tick."""
import importlib.util
import os
import re
import sys

_spec = importlib.util.spec_from_file_location("step_trace", os.path.join(os.path.dirname(__file__), "..", "tools",
                                                                            "step_trace.py"))
step_trace = importlib.util.module_from_spec(_spec)
sys.modules["step_trace"] = step_trace
_spec.loader.exec_module(step_trace)


def test_traces_one_steady_tick_and_lists_the_sampling_files(capsys):
    assert step_trace.main(["--streams", "2", "--ticks", "1", "--len", "12", "--no-header"]) == 0
    text = capsys.readouterr().out
    files, functions, calls, python, depth = map(int, re.search(
        r"median: (\d+) files, (\d+) functions, (\d+) slipstream calls \((\d+) Python calls\), (\d+) slipstream "
        r"frames deep", text).groups())
    assert 0 < files <= functions <= calls <= python and depth >= 2
    assert "slipstream/scheduler/engine_loop.py:EngineLoop.tick" in text  # the deepest chain starts at the tick
    assert sys.getprofile() is None  # the hook is off again
    assert "  slipstream/params.py: " in text  # the sampling path starts at SamplingParams

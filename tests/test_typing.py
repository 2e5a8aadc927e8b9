"""The whole package type-checks: mypy with pyproject's [tool.mypy], nothing silenced (torch's inline types).

Skipped where mypy is not installed (it is in the `test` extra). The whole-package run starts when the
suite starts (conftest.py: `start_early`), beside the tests before it, and this test waits for it. Its cache lives under
.pytest_cache/mypy: a cold run takes ~120 s of CPU on the 2-core dev machine (more wall time when
loaded), a warm one under 1 s.
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")


TIMEOUT_S = 1200  # a hang, not a loaded machine (~120 s of CPU cold)


def _start(*args: str) -> subprocess.Popen:
    cache = REPO / ".pytest_cache" / "mypy"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def mypy(*args: str) -> subprocess.CompletedProcess:
    return _finish(_start(*args))


_early: subprocess.Popen | None = None


def start_early() -> None:
    """Start the whole-package check when the suite starts (conftest, once this test is collected): a
    cold run is a minute of one core, which the tests before this one leave partly idle."""
    global _early
    if _early is None:
        _early = _start()


def stop_early() -> None:
    global _early
    if _early is not None and _early.poll() is None:
        _early.kill()
        _early.wait()
    _early = None


def test_the_package_type_checks():
    global _early
    proc, _early = _early, None
    result = _finish(proc) if proc is not None else mypy()  # the files of [tool.mypy]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_a_misspelt_field_fails_the_check(tmp_path):
    """The check has teeth: a sampling field read under a wrong name is an error, not a runtime surprise."""
    use = tmp_path / "use_site.py"
    use.write_text("from slipstream.runtime.batch import SamplingRow\n\n\n"
                   "def f(row: SamplingRow) -> float:\n    return row.temprature\n")
    proc = mypy(str(use))
    assert proc.returncode == 1 and '"SamplingRow" has no attribute "temprature"' in proc.stdout, proc.stdout

"""The whole package type-checks: mypy with pyproject's [tool.mypy], nothing silenced (torch's inline types).

Skipped where mypy is not installed (it is in the `test` extra). Its cache lives under
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


def mypy(*args: str) -> subprocess.CompletedProcess:
    cache = REPO / ".pytest_cache" / "mypy"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)  # a hang, not a loaded machine (~120 s of CPU cold)


def test_the_package_type_checks():
    proc = mypy()  # the files of [tool.mypy]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_a_misspelt_field_fails_the_check(tmp_path):
    """The check has teeth: a sampling field read under a wrong name is an error, not a runtime surprise."""
    use = tmp_path / "use_site.py"
    use.write_text("from slipstream.runtime.batch import SamplingRow\n\n\n"
                   "def f(row: SamplingRow) -> float:\n    return row.temprature\n")
    proc = mypy(str(use))
    assert proc.returncode == 1 and '"SamplingRow" has no attribute "temprature"' in proc.stdout, proc.stdout

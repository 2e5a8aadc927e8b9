"""Running Python as if some packages were not installed (the test venv has every extra).

`hider(names)` is source code that, run first in a fresh interpreter, installs a finder refusing
those top-level packages the way a missing one is refused (ModuleNotFoundError, which is what
`pytest.importorskip` skips on) and records each refused name in `ASKED`.
"""
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent

HIDER = """
import sys
HIDDEN, ASKED = set({hidden!r}), []
class _Hide:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in HIDDEN:
            ASKED.append(name)
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=top)
sys.meta_path.insert(0, _Hide())
"""


def hider(names) -> str:
    return HIDER.format(hidden=tuple(sorted(names)))


def start_python(source: str) -> subprocess.Popen:
    """`python -c source` in the repository root, this checkout first on the path."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "SLIPSTREAM_WEIGHT_CACHE": "0"}
    return subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=REPO)


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_python(source: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return finish(start_python(source), timeout)

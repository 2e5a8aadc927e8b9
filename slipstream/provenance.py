"""Provenance header for every raw benchmark output: what ran, on which code, where, with what, when.

    from slipstream.provenance import provenance, header
    print(header(provenance()))           # text/markdown outputs: a block of `- key: value` lines
    json.dump({"provenance": provenance(), ...})

The commit comes from a stamp whenever there is one (`.whl/provenance-git.json`, written here right
before a GPU call by tools/gpu/gpu_prepare.sh: `python -m slipstream.provenance stamp`), and from git
only without one. The copy of the tree a lent GPU machine receives may carry no `.git`, sit inside
another git work tree, or carry a git repository of its own at some other commit (2026-11-27 on an
H200: `99596d0 (dirty)` for a run of e8fbc7a), so there git cannot be trusted, and the stamp records
the commit, whether the tree was dirty and a hash of the uncommitted diff. When git answers
differently, the header says so beside the stamp. (Delete a stale `.whl/provenance-git.json` on a
development machine: it wins there too.)
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STAMP = REPO / ".whl" / "provenance-git.json"
PACKAGES = ("torch", "triton", "transformers", "cupy-cuda13x", "cupy-cuda12x", "gguf", "numpy", "msgspec", "uvloop",
            "fastapi", "uvicorn", "openai", "ray")


def _run(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state(repo: Path = REPO) -> dict | None:
    """{commit, dirty, diff_sha256} of a checkout, or None when `repo` is not the root of one. A copy
    of the tree that sits inside another repository's work tree is not (on 2026-11-27 a GPU run's
    header named that other checkout's HEAD): git would answer for the enclosing one."""
    top = _run(["git", "rev-parse", "--show-toplevel"], repo)
    if top is None or Path(top).resolve() != Path(repo).resolve():
        return None
    commit = _run(["git", "rev-parse", "HEAD"], repo)
    if commit is None:
        return None
    changed = _run(["git", "status", "--porcelain", "--untracked-files=no"], repo) or ""
    diff = _run(["git", "diff", "HEAD"], repo) or ""
    return {"commit": commit, "dirty": bool(changed),
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if changed else None,
            "source": "git"}


def git_info(repo: Path = REPO, stamp: Path | None = None) -> dict:
    """The stamp's commit whenever the stamp is there (default `STAMP`), else git's, else "unknown"."""
    stamp = STAMP if stamp is None else stamp
    state = git_state(repo)
    if stamp.exists():
        data = json.loads(stamp.read_text())
        source = f"stamp {stamp.name}, written {data.get('stamp_written_utc', '?')} before the call"
        keys = ("commit", "dirty", "diff_sha256")
        if state is not None and [state[k] for k in keys] != [data.get(k) for k in keys]:
            source += f"; git here says {state['commit'][:12]}{' (dirty)' if state['dirty'] else ''}, not used"
        return {**data, "source": source}
    if state is not None:
        return state
    return {"commit": "unknown", "dirty": None, "diff_sha256": None, "source": "no git checkout and no stamp"}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def _cpu_model() -> str | None:
    """The CPU's model name (platform.processor() is only "x86_64" on Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), None)


def device_info() -> dict:
    info: dict[str, Any] = {"machine": platform.platform(), "cpu": _cpu_model() or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}  # other processes sharing the cores
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    info["gpu"] = smi.splitlines() if smi else None
    return info


def provenance(command: list[str] | str | None = None, extra: dict | None = None) -> dict:
    """Everything a raw output's header records; `extra` adds tool-specific fields (e.g. llama.cpp's commit)."""
    if command is None:
        command = [Path(sys.executable).name, *sys.argv]
    return {"command": command if isinstance(command, str) else shlex.join(command),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git": git_info(), "device": device_info(), "versions": versions(), **(extra or {})}


def header(prov: dict) -> str:
    """The provenance as `- key: value` lines (markdown-friendly), then a blank line."""
    git = prov["git"]
    dirty = {True: " (dirty, diff " + str(git.get("diff_sha256")) + ")", False: " (clean)"}.get(git.get("dirty"), "")
    lines = [f"- command: `{prov['command']}`", f"- date (UTC): {prov['date_utc']}",
             f"- git: {git['commit']}{dirty} [{git['source']}]",
             f"- machine: {prov['device']['machine']}, {prov['device']['cpu']}, {prov['device']['cores']} cores "
             f"(load average {'/'.join(map(str, prov['device']['load_avg_at_start']))} at start), "
             f"gpu: {'; '.join(prov['device']['gpu']) if prov['device']['gpu'] else 'none'}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in prov["versions"].items())]
    lines += [f"- {k}: {v}" for k, v in prov.items() if k not in ("command", "date_utc", "git", "device", "versions")]
    return "\n".join(lines) + "\n"


def write_stamp(stamp: Path = STAMP) -> dict:
    """Record this checkout's git state for a copy of the tree that will have no `.git`."""
    state = git_state()
    if state is None:
        raise SystemExit("provenance stamp: not a git checkout")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    written = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    stamp.write_text(json.dumps({**{k: v for k, v in state.items() if k != "source"}, "stamp_written_utc": written})
                     + "\n")
    return state


if __name__ == "__main__":
    if sys.argv[1:] == ["stamp"]:
        print(json.dumps(write_stamp()))
    else:
        print(header(provenance()), end="")

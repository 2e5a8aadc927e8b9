"""The header every raw result file starts with: command, commit (+dirty), machine, versions, date."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "?"


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def header(command: str | None = None, packages=("torch", "fastapi", "uvicorn", "uvloop", "httpx", "openai",
                                                 "msgspec")) -> str:
    dirty = "+dirty" if _git("status", "--porcelain", "--untracked-files=no") else ""
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        f"command: {command or ' '.join([os.path.basename(sys.executable), *sys.argv])}",
        f"commit: {_git('rev-parse', '--short=12', 'HEAD')}{dirty}",
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs ({_cpu()}), no GPU used; "
        f"load average at start {load} (cores shared with other sessions)",
        f"versions: python {platform.python_version()}, " + ", ".join(f"{p} {_version(p)}" for p in packages),
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(header(" ".join(sys.argv[1:]) or None))

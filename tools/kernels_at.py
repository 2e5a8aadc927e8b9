"""The compiled CPU kernels as another commit's sources build them: for benchmarks that compare a
kernel change against its base in one process (old and new interleaved), without a runtime switch in
the engine."""
from __future__ import annotations

import ctypes
import subprocess
import tempfile
from pathlib import Path

from slipstream.models.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[1]


def library_at(ref: str) -> ctypes.CDLL:
    """cpu_kernels.SOURCES as of git `ref`, compiled with the same flags into a temporary .so."""
    cc = cpu_kernels._compiler()
    if cc is None:
        raise SystemExit("no C compiler")
    tmp = Path(tempfile.mkdtemp(prefix="kernels-"))
    for src in cpu_kernels.SOURCES:
        rel = src.resolve().relative_to(ROOT)
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{rel}"], capture_output=True, text=True,
                              check=True).stdout
        (tmp / src.name).write_text(text)
    out = tmp / "cpu.so"
    subprocess.run([cc, *cpu_kernels.FLAGS, *(str(tmp / s.name) for s in cpu_kernels.SOURCES), "-lm", "-o", str(out)],
                   check=True)
    return cpu_kernels._declare(ctypes.CDLL(str(out)))


def describe(ref: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True,
                          check=True).stdout.strip()

"""The compiled CPU kernels as another commit's sources build them: for benchmarks that compare a
kernel change against its base in one process (old and new interleaved), without a runtime switch in
the engine."""
from __future__ import annotations

import ctypes
import re
import subprocess
import tempfile
from pathlib import Path

from slipstream.models.kernels import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]


def library_at(ref: str) -> ctypes.CDLL:
    """The compiled kernels as of git `ref`: its kernel sources (the .c files its cpu_kernels.py lists,
    with every .c and .h of that folder beside them), compiled with this checkout's flags into a
    temporary .so and declared with this checkout's signatures (the functions the forward calls)."""
    cc = cpu_kernels._compiler()
    if cc is None:
        raise SystemExit("no C compiler")
    folder = Path(cpu_kernels.__file__).resolve().parent.relative_to(ROOT)

    def show(path: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:{folder}/{path}"], capture_output=True,
                              text=True, check=True).stdout

    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", ref, f"{folder}/"],
                            capture_output=True, text=True, check=True).stdout.split()
    tmp = Path(tempfile.mkdtemp(prefix="kernels-"))
    for name in (Path(p).name for p in listed if p.endswith((".c", ".h"))):
        (tmp / name).write_text(show(name))
    spec = show("cpu_kernels.py")
    sources = re.findall(r'"(\w+\.c)"', spec[spec.index("SOURCES"):spec.index("\n\n", spec.index("SOURCES"))])
    out = tmp / "cpu.so"
    subprocess.run([cc, *cpu_kernels.FLAGS, *(str(tmp / s) for s in sources), "-lm", "-o", str(out)], check=True)
    lib = cpu_kernels._declare(ctypes.CDLL(str(out)), missing_ok=True)  # (kernels added since `ref` are absent)
    if lib.sq_abi_version() < 3:  # these returned nothing before: check_rc passes None
        for name in ("sq_gemm_u4", "sq_gemm_u4_q8", "sq_gemm_u4_q16"):
            if hasattr(lib, name):
                getattr(lib, name).restype = None
    return lib


def describe(ref: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True,
                          check=True).stdout.strip()

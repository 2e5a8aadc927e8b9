"""The compiled CPU kernels (quant_matmul*_cpu.c, layer_ops_cpu.c, llama_forward_cpu.c): built at first use.

The C files are compiled with the system's C compiler (`$CC`, else `cc`, else `gcc`) for the CPU they
run on (-march=native) into one library, `<cache>/kernels/cpu-<key>.so`, where <key> hashes the
sources, the flags, the compiler's version and the CPU's model and feature flags: a new slipstream,
compiler or machine gets its own build, and every later start only loads the file (milliseconds).
The first compile takes seconds of compiler CPU time, minutes of wall time on a loaded 2-core machine
(docs/benchmarks.md, "First start, measured again"); the CLI says so in one line. The library
links OpenMP; loaded after torch, it shares torch's OpenMP runtime (same soname), so its thread team
is the one `torch.set_num_threads` sized on the calling thread. ctypes releases the GIL around each
call, so the loop runs while a kernel does.

Without a compiler, when it fails, or with `SLIPSTREAM_NATIVE_KERNELS=0`, `native_kernels()` returns
None once and logs why; the model then runs the pure-torch paths (dequantized weights, the
reference forward).

Every kernel that allocates scratch memory checks it (kernel_alloc_cpu.h) and returns SQ_ENOMEM when
it cannot have it; `check_rc` turns that into MemoryError and a shape the kernel does not handle
(SQ_EINVAL) into ValueError.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import structlog

from slipstream.logging_setup import first_start_phase

log = structlog.get_logger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("quant_matmul_cpu.c", "quant_matmul_q8_cpu.c",
                                                       "quant_matmul_q16_cpu.c", "layer_ops_cpu.c",
                                                       "llama_forward_cpu.c"))
HEADERS = tuple(Path(__file__).with_name(n) for n in ("quant_rounded_cpu.h", "kernel_alloc_cpu.h"))  # included by
# SOURCES: hashed into the key too
ABI_VERSION = 6  # sq_abi_version() of the sources whose signatures _declare describes
SQ_EINVAL, SQ_ENOMEM = -1, -2  # the kernels' return codes (kernel_alloc_cpu.h); 0: done
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_OFF = {"0", "false", "no", "off"}


def check_rc(rc: int | None, invalid: str) -> None:
    """Raise for a kernel's return code: MemoryError for SQ_ENOMEM (its scratch could not be
    allocated), ValueError(`invalid`) for any other non-zero code. None (a kernel of an older build
    that returned nothing, tools/common/kernels_at.py) passes."""
    if rc is None or rc == 0:
        return
    if rc == SQ_ENOMEM:
        raise MemoryError("a compiled CPU kernel could not allocate its scratch memory")
    raise ValueError(invalid)


def cpu_identity() -> str:
    """Model name and feature flags of this CPU (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in text.splitlines()
            if line.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return platform.machine() + "\n" + "\n".join(sorted(set(keep)))


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc) or shutil.which("gcc")


def build_key(cc: str) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for part in (*(s.read_bytes() for s in SOURCES + HEADERS), " ".join(FLAGS).encode(), version.encode(),
                 cpu_identity().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def library_path(cc: str) -> Path:
    from slipstream.models.loading.weight_cache import cache_root

    return cache_root() / "kernels" / f"cpu-{build_key(cc)}.so"


# For a compiler that hangs, not a slow one: -O3 of SOURCES takes ~60 s of CPU, and 4 minutes on a
# loaded 2-core machine, where the old 300 s limit turned the kernels off without a word to the user.
COMPILE_TIMEOUT_S = 1800


def compile_library(cc: str, out: Path) -> float:
    """Compile SOURCES into `out` (atomically: a temp file renamed into place); returns the seconds. A
    compiler without OpenMP (Apple's clang) gets a second try without it: single-threaded kernels."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp: str | None
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".tmp")
    os.close(fd)
    t0 = time.perf_counter()
    try:
        for flags in (FLAGS, tuple(f for f in FLAGS if f != "-fopenmp")):
            done = subprocess.run([cc, *flags, *map(str, SOURCES), "-lm", "-o", tmp], capture_output=True,
                                  text=True, timeout=COMPILE_TIMEOUT_S)
            if done.returncode == 0:
                break
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
        tmp = None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return time.perf_counter() - t0


class QMat(ctypes.Structure):
    """qmat_t of llama_forward_cpu.c: one QuantWeight."""
    _fields_ = [("kind", ctypes.c_int64), ("f16", ctypes.c_int64), ("group", ctypes.c_int64),
                ("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("values", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("offsets", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """layer_t of llama_forward_cpu.c."""
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("qkv", QMat), ("o", QMat),
                ("gate_up", QMat), ("down", QMat), ("window", ctypes.c_int64)]


class LoraStep(ctypes.Structure):
    """lora_t of llama_forward_cpu.c: a step's LoRA adapters for the one-call stack (LoraGroups.native_step)."""
    _fields_ = [("tok", ctypes.c_void_p), ("seg", ctypes.c_void_p), ("G", ctypes.c_int64), ("rec", ctypes.c_void_p),
                ("rec_stride", ctypes.c_int64), ("layer_stride", ctypes.c_int64), ("mid", ctypes.c_void_p),
                ("rmax", ctypes.c_int64)]


def _declare(lib: ctypes.CDLL, names: tuple[str, ...] | None = None, missing_ok: bool = False) -> ctypes.CDLL:
    """The argument and result types of the kernels `lib` exports (`names`: only those; default: all).
    `missing_ok`: skip the ones it lacks (an older commit's build: tools/common/kernels_at.py)."""
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {  # name: (argument types, result type)
        "sq_abi_version": ([], i32),
        "sq_max_threads": ([], i32),
        "sq_fail_allocs": ([i64], None),
        "sq_gemm_u4": ([p, i64, i64, p, p, p, i32, i64, p, i64, i32], i32),
        "sq_gemm_i8": ([p, i64, i64, p, p, p, i32, i64, i64, p, i64, i32], i32),
        "sq_gemm_u4_q8": ([p, i64, i64, p, p, p, i32, i64, p, i64], i32),
        "sq_gemm_i8_q8": ([p, i64, i64, p, p, p, i32, i64, i64, p, i64], i32),
        "sq_gemm_u4_q16": ([p, i64, i64, p, p, p, i32, i64, p, i64], i32),
        "sq_gemm_i8_q16": ([p, i64, i64, p, p, p, i32, i64, i64, p, i64], i32),
        "sq_q16_vnni": ([], i32),
        "sq_dequant_rows": ([i32, p, p, p, i32, i64, i64, p, i64, p], None),
        "sq_add_rms_norm": ([p, p, p, f32, p, i64, i64, p, i64], None),
        "sq_rotary_kv": ([p, p, p, i64, i64, i64, p, p, p, p, p, p, i64, i64, i64, i64], None),
        "sq_attention": ([p, i64, p, p, p, p, p, i64, i64, i64, i64, i64, i64, f32, i64, p], i32),
        "sq_silu_mul": ([p, i64, p, i64, p, i64, i64], None),
        "sq_lora_add": ([p, i64, i64, p, p, i64, p, i64, p, i64, p, p, p], i32),
        "sq_decoder_forward": ([p, i64, f32, p, i64, i64, i64, i64, i64, i64, p, p, i64, p, p, p, p, p, p, p, i64,
                                i64, i64, f32, p, p, i64, p, p], i32),
    }
    for name, (args, result) in signatures.items():
        if names is not None and name not in names:
            continue
        fn = getattr(lib, name, None) if missing_ok else getattr(lib, name)
        if fn is None:
            continue
        fn.argtypes, fn.restype = args, result
    return lib


@functools.lru_cache(maxsize=1)
def native_kernels() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) when they cannot be built or loaded here."""
    import torch  # noqa: F401 - loads torch's OpenMP runtime first, which the library then shares

    if os.environ.get("SLIPSTREAM_NATIVE_KERNELS", "1").strip().lower() in _OFF:
        log.info("cpu_kernels_off", reason="SLIPSTREAM_NATIVE_KERNELS=0")
        return None
    cc = _compiler()
    if cc is None:
        log.warning("cpu_kernels_unavailable", reason="no C compiler (cc, gcc or $CC) on PATH")
        return None
    try:
        path = library_path(cc)
        if not path.is_file():
            seconds = compile_library(cc, path)
            log.info("cpu_kernels_compiled", path=str(path), seconds=round(seconds, 2))
            first_start_phase("compiled the CPU kernels for this machine", seconds, cached_in=str(path))
        lib = _declare(ctypes.CDLL(str(path)))
        if lib.sq_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path}: ABI {lib.sq_abi_version()}, expected {ABI_VERSION}")
    except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
        log.warning("cpu_kernels_unavailable", reason=f"{type(exc).__name__}: {exc}")
        return None
    return lib

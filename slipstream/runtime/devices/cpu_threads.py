"""How many intra-op threads the CPU forward runs on: measured on the machine it runs on, once.

A decode step of a small model is bound by memory bandwidth, which a second thread may or may not
add to; and every thread of the forward's OpenMP team waits at each kernel's barrier for the slowest,
so a team that spans every core stalls whenever the engine loop (or another process) takes one of
them. Which effect wins depends on the machine and its load, so it is measured, not assumed: the
model's batch-1 decode forward, timed on the compute stream's own thread with 1, 2, 4, ... threads up
to torch's setting, interleaved, medians compared (more threads must win by 10% to be chosen). The
choice is kept in `<cache>/kernels/threads-<key>.json` (key: this CPU, the model's shape, the thread
ceiling), so a machine measures once, at its first start; delete the file, or set
`SLIPSTREAM_RECALIBRATE=1`, to measure again (after a change of machine load, say). Only the "cpu"
kernel backend is calibrated; the reference backend keeps the device's default.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import structlog
import torch

from slipstream.logging_setup import first_start_phase
from slipstream.models.kernels.attention import AttentionMetadata
from slipstream.models.base import ForwardBatch, KVCache

log = structlog.get_logger(__name__)

CONTEXT = 64  # tokens already in the sequence the measured decode step extends
REPEATS = 7
MARGIN = 0.9  # more threads are chosen only when their median is below MARGIN x the fewer's


def candidates(ceiling: int) -> list[int]:
    """1, 2, 4, ... up to `ceiling` (and `ceiling` itself)."""
    out, n = [], 1
    while n < ceiling:
        out.append(n)
        n *= 2
    return out + [max(1, ceiling)]


def _key(model, ceiling: int) -> str:
    from slipstream.models.kernels.cpu_kernels import cpu_identity

    c = model.config
    shape = (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size)
    weights = sorted({type(m).__name__ for m in model.modules()})
    text = json.dumps([cpu_identity(), shape, weights, ceiling, torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _record_path(model, ceiling: int) -> Path:
    from slipstream.models.loading.weight_cache import cache_root

    return cache_root() / "kernels" / f"threads-{_key(model, ceiling)}.json"


def time_decode_step(model, threads: list[int], repeats: int = REPEATS) -> dict[int, float]:
    """Median wall ms of one batch-1 decode forward for each thread count, measured interleaved on
    the calling thread (whose thread setting is left at the last count measured)."""
    c = model.config
    page = 16
    pages = -(-(CONTEXT + 1) // page)
    kv = KVCache(c, pages + 1, page, torch.float32, torch.device("cpu"))
    kv.k[:, page:].normal_()  # written context (page 0 is scratch)
    kv.v[:, page:].normal_()
    table = list(range(1, pages + 1))
    times: dict[int, list[float]] = {n: [] for n in threads}
    for rep in range(repeats + 2):  # two warm-ups per count
        for n in threads:
            torch.set_num_threads(n)
            meta = AttentionMetadata([0, 1], [CONTEXT + 1], [table], page)
            batch = ForwardBatch(torch.tensor([7]), torch.tensor([CONTEXT]), torch.tensor([page + CONTEXT]),
                                 torch.tensor([0]), meta)
            t0 = time.perf_counter()
            with torch.no_grad():
                model(batch, kv)
            if rep >= 2:
                times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: statistics.median(ts) for n, ts in times.items()}


def choose(medians: dict[int, float]) -> int:
    best = min(medians)
    for n in sorted(medians):
        if medians[n] < MARGIN * medians[best]:
            best = n
    return best


def forward_threads(model, ceiling: int) -> int:
    """The thread count for the forward, from the cached measurement or a new one. Runs on (and sets)
    the calling thread: call it on the compute stream."""
    if ceiling <= 1:
        torch.set_num_threads(1)
        return 1
    path = _record_path(model, ceiling)
    fresh = os.environ.get("SLIPSTREAM_RECALIBRATE", "0").strip().lower() in ("1", "true", "yes", "on")
    if path.is_file() and not fresh:
        try:
            n = int(json.loads(path.read_text())["threads"])
            torch.set_num_threads(n)
            return n
        except (OSError, ValueError, KeyError):
            pass  # damaged: measure again
    t0 = time.perf_counter()
    medians = time_decode_step(model, candidates(ceiling))
    n = choose(medians)
    torch.set_num_threads(n)
    record = {"threads": n, "median_ms": {str(k): round(v, 3) for k, v in medians.items()},
              "load_average": os.getloadavg(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "context": CONTEXT, "repeats": REPEATS}
    seconds = time.perf_counter() - t0
    log.info("cpu_forward_threads_measured", threads=n, median_ms=record["median_ms"], seconds=round(seconds, 2))
    first_start_phase(f"measured the CPU forward's thread count ({n} of {ceiling}) for this machine", seconds,
                      cached_in=str(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("cpu_forward_threads_not_stored", path=str(path), error=str(exc))
    return n

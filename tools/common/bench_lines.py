"""What the table-printing benchmark tools share: a percentile, the lines of their tables (printed
as they come), a raw file with the provenance header (of a plain or an asyncio body), the process's
RSS, seeded random pictures, and stopping a server."""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np

from slipstream import provenance as prov


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def emit(lines: list[str], line: str = "") -> None:
    print(line, flush=True)
    lines.append(line)


def report(body: Callable[[], list[str]], out: Path | None) -> None:
    """Print the provenance header, run `body` (which emits its lines), and write both to `out`."""
    head = prov.header(prov.provenance())
    print(head, end="")
    lines = body()
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(head + "\n".join(lines) + "\n")


def report_async(run: Callable, args, out: Path | None) -> None:
    """`report` of `await run(args, lines)` on uvloop (the engine's loop of choice)."""
    def body() -> list[str]:
        import uvloop

        lines: list[str] = []
        uvloop.run(run(args, lines))
        return lines

    report(body, out)


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def picture(seed: int, width: int, height: int):
    """A random RGB picture, the same for the same seed."""
    from PIL import Image

    rs = np.random.RandomState(seed)
    return Image.fromarray(rs.randint(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (a server drains and exits), then SIGKILL after `timeout` seconds."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()

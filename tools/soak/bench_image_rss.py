"""RSS around requests with big pictures (issue 37, item 9): is memory bounded, and given back?

    python tools/soak/bench_image_rss.py --out docs/results/inputs-2026-11-27/image_rss.txt

One in-process Engine on the tiny random Idefics3 (tests/idefics3_fixture.py, built into a temporary
folder; the model resizes every picture to 128 px, so what grows is the decoding, not the model's
input). Each scenario sends `--repeat` requests, one after another, each with N encoded PNG pictures
of P megapixels (smooth gradients: a few hundred KB each, decoded to 3 bytes a pixel). Printed per
request: its outcome, RSS after it ended (the engine settled), and the peak RSS while it ran
(sampled every 5 ms). The process's RSS before the first request is the baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the slipstream of this checkout
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "common"))  # the shared helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the tiny Idefics3 fixture

from bench_lines import emit, report_async, rss_mb  # noqa: E402

SCENARIOS = [(8, 40), (2, 40), (8, 12)]  # (pictures per request, megapixels each)


class Peak:
    """The largest RSS seen by a sampling thread while the `with` block runs."""

    def __enter__(self) -> "Peak":
        self.peak, self._stop = rss_mb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_mb())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def picture(megapixels: int, seed: int) -> bytes:
    """A PNG of a smooth gradient, about `megapixels` million pixels (4:3)."""
    import numpy as np
    from PIL import Image

    h = int((megapixels * 1e6 * 3 / 4) ** 0.5)
    w = int(megapixels * 1e6 / h)
    x = np.linspace(0, 255, w, dtype=np.float32)
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None]
    rgb = np.stack([np.broadcast_to(x, (h, w)), np.broadcast_to(y, (h, w)),
                    np.full((h, w), seed * 37 % 256, np.float32)], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, "PNG", compress_level=1)
    return buf.getvalue()


async def run(args, lines: list[str]) -> None:
    from idefics3_fixture import tiny_idefics3_folder

    from slipstream import Engine, EngineConfig, SamplingParams
    from slipstream.errors import SlipstreamError

    folder = tiny_idefics3_folder(Path(tempfile.mkdtemp(prefix="bench-image-rss-")))
    pngs = {mp: [picture(mp, i) for i in range(8)] for mp in sorted({mp for _, mp in SCENARIOS})}
    config = EngineConfig(model=str(folder), kv_cache_tokens=4096, max_num_batched_tokens=512)
    async with Engine(config) as engine:
        await engine.complete("warm up", SamplingParams(max_tokens=2))
        base = rss_mb()
        emit(lines, f"baseline RSS {base:.1f} MB (engine started, one text request done)")
        emit(lines, "")
        emit(lines, "| pictures x MP | request | outcome | RSS after, MB (vs baseline) | peak RSS while it ran, MB |")
        emit(lines, "|---|---:|---|---:|---:|")
        for n, mp in SCENARIOS:
            for k in range(args.repeat):
                with Peak() as peak:
                    try:
                        out = await engine.complete("<image>" * n + "Describe.", SamplingParams(max_tokens=4),
                                                    images=pngs[mp][:n])
                        outcome = f"ok ({out.usage.prompt_tokens} prompt tokens)"
                    except SlipstreamError as e:
                        outcome = f"{type(e).__name__}(param={getattr(e, 'param', None)!r})"
                    await asyncio.sleep(0.3)  # (finalizers, and the allocator trim they start on a thread)
                after = rss_mb()
                emit(lines, f"| {n} x {mp} | {k + 1} | {outcome} | {after:.1f} ({after - base:+.1f}) | "
                            f"{peak.peak:.1f} ({peak.peak - base:+.1f}) |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    report_async(run, args, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

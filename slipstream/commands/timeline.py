"""`slipstream timeline`: a PNG of host vs device activity over a window of steps, depth 1 and 2.

Runs the bench workload once per depth with tracing on, picks `--steps` consecutive steady-state
decode steps from the middle of each run, and draws one panel per depth: host lanes (plan,
launch, finalize, commit; the wait for the copy event is hatched) above device lanes (forward,
sample, copy). Bars are coloured by StepSlot (ping-pong A/B); red marks time when no device
stream runs (the bubble). Both panels share one time axis, so the shorter pipelined window shows.
"""
from __future__ import annotations

import asyncio

LANES = ["plan", "launch", "finalize", "commit", "forward", "sample", "copy"]
SLOT_COLORS = {0: ("#4c72b0", "#a6bddb"), 1: ("#dd8452", "#f5c9a8")}  # (device, host) per slot
IDLE = "#d62728"

from slipstream.cli import add_log_args, add_model_args, needs_extra
from slipstream.errors import InvalidRequestError


def register(sub) -> None:
    p = sub.add_parser("timeline", help="PNG of host vs device activity, depth 1 vs depth 2")
    add_model_args(p, dtype=False)
    p.add_argument("--streams", type=int, default=8, help="concurrent streams (one run per depth)")
    p.add_argument("--len", type=int, default=24, dest="output_len", help="output tokens per stream")
    p.add_argument("--steps", type=int, default=4, help="consecutive decode steps to draw")
    p.add_argument("--out", default="timeline.png", help="the PNG to write")
    p.add_argument("--zoom", type=float, default=0.0, metavar="MS",
                   help="add a column showing MS milliseconds from the end of a forward (0: none)")
    add_log_args(p)
    p.set_defaults(func=_timeline)


async def capture(model: str, device: str, depth: int, streams: int, output_len: int, steps: int) -> dict:
    """Run the workload traced; return the window's spans (seconds from its start) and busy share."""
    from slipstream.bench import run_workload, start_engine
    from slipstream.trace import covered

    engine = await start_engine(model, device, depth, streams, output_len)
    try:
        _, traces, _ = await run_workload(engine, streams, output_len)
        tracer = engine.tracer
        steady = [t for t in traces if t.kind == "decode" and t.num_seqs == streams and t.contiguous]
        if len(steady) < steps:
            raise InvalidRequestError(f"timeline: only {len(steady)} steady decode steps for --steps {steps}; "
                                      "raise --len", param="len")
        mid = len(steady) // 2 - steps // 2
        window = steady[mid: mid + steps]
        first, last = window[0].step_id, window[-1].step_id
        t0, t1 = window[0].start, window[-1].start + window[-1].period
        dev = [s for s in tracer.device_spans(first - 1, last + 1) if s.end > t0 and s.start < t1]
        host = [h for h in tracer.host_spans(first - 1, last + 1) if h.end > t0 and h.start < t1]
        slot = {k: tracer.host[k].slot for k in range(first - 1, last + 2) if k in tracer.host}
        busy = covered([(s.start, s.end) for s in dev], t0, t1)
        return {"depth": depth, "t0": t0, "t1": t1, "fwd_end": window[0].start + window[0].forward, "dev": dev,
                "host": host, "slot": slot,
                "busy": busy / (t1 - t0), "period": sorted(t.period for t in window)[steps // 2],
                "idle": sum(t.idle for t in window) / steps}
    finally:
        await engine.close()


def _gaps(spans, t0: float, t1: float) -> list[tuple[float, float]]:
    """Intervals of [t0, t1) where no device span runs."""
    out, reach = [], t0
    for s, e in sorted((s.start, s.end) for s in spans):
        if s > reach:
            out.append((reach, min(s, t1)))
        reach = max(reach, e)
    if reach < t1:
        out.append((reach, t1))
    return [(a, b) for a, b in out if b > a]


def _draw(ax, p: dict, lo: float, hi: float, origin: float) -> None:
    """Lanes of one panel over [lo, hi) (perf_counter seconds), x in ms from `origin`."""
    ms = lambda t: (t - origin) * 1e3  # noqa: E731
    min_w = (hi - lo) * 1e3 / 900  # ~1 px: sub-pixel host spans next to a long forward stay visible
    row = {lane: len(LANES) - 1 - i for i, lane in enumerate(LANES)}
    # true width: a bubble too short to see should look so; only inside the captured window
    for a, b in _gaps(p["dev"], max(lo, p["t0"]), min(hi, p["t1"])):
        ax.axvspan(ms(a), ms(b), ymin=0, ymax=3 / len(LANES), color=IDLE, lw=0)
    for s in p["dev"]:
        lane = "copy" if s.label in ("h2d", "d2h") else s.label
        color = SLOT_COLORS[p["slot"].get(s.step, 0) % 2][0]
        ax.broken_barh([(ms(s.start), max((s.end - s.start) * 1e3, min_w))], (row[lane] - 0.35, 0.7), color=color)
    for h in p["host"]:
        lane = "commit" if h.lane == "commit_wait" else h.lane
        color = SLOT_COLORS[p["slot"].get(h.step, 0) % 2][1]
        wait = h.lane == "commit_wait"
        ax.broken_barh([(ms(h.start), max((h.end - h.start) * 1e3, 0 if wait else min_w))],
                       (row[lane] - 0.35, 0.7), facecolor="none" if wait else color,
                       edgecolor=color if wait else "none", hatch="////" if wait else None, lw=0.5)
    ax.axhline(2.5, color="0.6", lw=0.8)
    ax.set_yticks(range(len(LANES)), [f"{lane} " for lane in reversed(LANES)])
    ax.set_ylim(-0.7, len(LANES) - 0.3)
    ax.set_xlim(ms(lo), ms(hi))


def render(panels: list[dict], out: str, title: str, zoom_ms: float = 0.0) -> None:
    """One row per depth; with `zoom_ms`, a second column zooms on one step boundary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    span = max(p["t1"] - p["t0"] for p in panels)
    cols = 2 if zoom_ms > 0 else 1
    fig, axes = plt.subplots(len(panels), cols, figsize=(12 + 4 * (cols - 1), 2.1 * len(panels) + 0.9),
                             sharex="col", squeeze=False, width_ratios=[3, 1][:cols])
    for (ax, *zax), p in zip(axes, panels):
        _draw(ax, p, p["t0"], p["t0"] + span, p["t0"])
        kind = "blocking" if p["depth"] == 1 else "pipelined"
        ax.set_title(f"depth {p['depth']} ({kind}): device busy {100 * p['busy']:.1f}%  ·  period "
                     f"{p['period'] * 1e3:.2f} ms  ·  device idle {p['idle'] * 1e3:.2f} ms/step", fontsize=10)
        ax.text(-0.075, 0.7, "host", transform=ax.transAxes, va="center", rotation=90, fontsize=9, color="0.3")
        ax.text(-0.075, 0.22, "device", transform=ax.transAxes, va="center", rotation=90, fontsize=9, color="0.3")
        if zax:  # from the end of one forward to (with a wide enough zoom) the start of the next
            e = p["fwd_end"]
            _draw(zax[0], p, e - 0.1 * zoom_ms / 1e3, e + 0.9 * zoom_ms / 1e3, e)
            zax[0].set_yticklabels([])
            zax[0].set_title(f"zoom: the first {zoom_ms:g} ms after a forward ends", fontsize=10)
    axes[-1][0].set_xlabel("ms from the first step of the window")
    if cols == 2:
        axes[-1][1].set_xlabel("ms from the end of the forward")
    fig.legend(handles=[Patch(color=SLOT_COLORS[0][0], label="slot A"), Patch(color=SLOT_COLORS[1][0], label="slot B"),
                        Patch(facecolor="none", edgecolor="0.4", hatch="////", label="waiting for the copy"),
                        Patch(color=IDLE, label="device idle")], loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _timeline(args) -> int:
    if args.steps < 1 or args.streams < 1 or args.output_len < args.steps + 4:
        raise InvalidRequestError("timeline: need --steps >= 1, --streams >= 1, --len >= --steps + 4")
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise needs_extra("plot", "slipstream timeline", e) from None
    panels = [asyncio.run(capture(args.model, args.device, d, args.streams, args.output_len, args.steps))
              for d in (1, 2)]
    title = f"{args.model} on {args.device}, {args.streams} streams: {args.steps} decode steps"
    render(panels, args.out, title, args.zoom)
    for p in panels:
        print(f"depth {p['depth']}: device busy {100 * p['busy']:.1f}%, period {p['period'] * 1e3:.2f} ms, "
              f"device idle {p['idle'] * 1e3:.3f} ms/step")
    print(f"wrote {args.out}")
    return 0

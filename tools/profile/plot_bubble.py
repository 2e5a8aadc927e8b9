"""Plots for docs/bubble.md from `slipstream bench --json` output.

    slipstream bench --json > run.json
    python tools/profile/plot_bubble.py run.json [more.json ...] --out docs/img

Writes bubble_steps.png (each step split into forward, sampling and device idle, per depth) and
bubble_model.png (the cost model's prediction against the wall clock for every repeat, and the
bubble's share of a step: the most that hiding it can win).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def load(paths: list[str]) -> list[tuple[str, dict]]:
    rows = []
    for p in paths:
        doc = json.loads(pathlib.Path(p).read_text())
        rows += [(doc["model"], r) for r in doc["results"]]
    return rows


def plot_steps(rows, out: pathlib.Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.0))
    labels, x = [], 0.0
    for model, r in rows:
        for d in (1, 2):
            s = r[f"depth{d}"]["steady"]
            parts = [s["forward_ms"], s["sampling_ms"], s["idle_ms"]]
            share = np.array(parts) / s["period_ms"] * 100
            left = 0.0
            for value, pct, color in zip(parts, share, ("#4c72b0", "#55a868", "#d62728")):
                ax.barh(x, pct, left=left, color=color, height=0.7)
                left += pct
            ax.text(101, x, f"{s['period_ms']:.2f} ms  (idle {s['idle_ms']:.2f})", va="center", fontsize=8)
            labels.append(f"{model} · {r['streams']} str · depth {d}")
            x += 1
        x += 0.4
    ax.set_yticks([i + 0.4 * (i // 2) for i in range(len(labels))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 125)
    ax.set_xticks(range(0, 101, 20))
    ax.set_xlabel("share of the step period (%)")
    ax.legend(["forward", "sampling + copies", "device idle"], fontsize=8, loc="upper center", ncol=3,
              bbox_to_anchor=(0.5, -0.16), frameon=False)
    ax.set_title("Where a step's time goes (steady-state medians)", fontsize=10, loc="left")
    fig.tight_layout()
    fig.savefig(out / "bubble_steps.png", dpi=90)
    plt.close(fig)


def _identity(c: dict) -> float:
    """The accounting identity's speedup (named `predicted_speedup` in files written before issue 16)."""
    return c["identity_speedup"] if "identity_speedup" in c else c["predicted_speedup"]


def plot_model(rows, out: pathlib.Path) -> None:
    """Left: the accounting identity vs observed speedup, every repeat. Right: what hiding the bubble can win."""
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"smollm2-135m": "o", "tiny-random": "s"}
    colors = {1: "#4c72b0", 8: "#55a868", 32: "#dd8452"}
    for model, r in rows:
        for c in r["repeats"]:
            ax.scatter(100 * (c["observed_speedup"] - 1), 100 * (_identity(c) - 1), s=28,
                       marker=markers.get(model, "^"), color=colors.get(r["streams"], "0.3"), alpha=0.85, zorder=3)
    lim = max(abs(v) for _, r in rows for c in r["repeats"]
              for v in (100 * (c["observed_speedup"] - 1), 100 * (_identity(c) - 1))) + 3
    xs = np.array([-lim, lim])
    ax.fill_between(xs, xs - 3, xs + 3, color="0.9", label="±3 pp")
    ax.plot(xs, xs, color="0.5", lw=0.8)
    for model, m in markers.items():
        ax.scatter([], [], marker=m, color="0.4", label=model)
    for n, col in colors.items():
        ax.scatter([], [], marker="o", color=col, label=f"{n} streams")
    ax.set_xlim(-lim, lim)
    ax.set_ylim(-lim, lim)
    ax.set_xlabel("observed speedup, depth 2 over depth 1 (%)")
    ax.set_ylabel("accounting identity: T_block / T_pipe × (1 − z)  (%)")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    ax.set_title("Accounting identity (fed by both depths) vs wall clock", fontsize=10, loc="left")

    f = np.logspace(-0.5, np.log10(600), 200)
    for b, ls in ((0.5, "--"), (2.0, "-")):
        bx.plot(f, 100 * b / f, color="0.5", lw=1, ls=ls, label=f"a {b:g} ms bubble")
    for model, r in rows:
        s = r["depth1"]["steady"]
        fs = s["forward_ms"] + s["sampling_ms"]
        bx.scatter([fs], [100 * s["idle_ms"] / fs], marker=markers.get(model, "^"),
                   color=colors.get(r["streams"], "0.3"))
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.set_xlabel("forward + sampling per step (ms)")
    bx.set_ylabel("depth-1 device idle ÷ (forward + sampling) (%)")
    bx.legend(fontsize=7, frameon=False)
    bx.set_title("The most pipelining can win: the bubble's share", fontsize=10, loc="left")
    fig.tight_layout()
    fig.savefig(out / "bubble_model.png", dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", default="docs/img")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = load(args.json)
    plot_steps(rows, out)
    plot_model(rows, out)
    print(f"wrote {out / 'bubble_steps.png'} and {out / 'bubble_model.png'}")


if __name__ == "__main__":
    main()

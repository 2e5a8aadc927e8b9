"""Intercept and slope of tools/bench_host.py's per-step medians, from its --json-out files: over every
N it ran, and over N = 1, 32, 256 (the set issue 36 measured on main), wall and CPU; per file.

    python docs/results/host-2026-11-27/fits.py docs/results/host-2026-11-27/bench_host_*.json
"""
import json
import statistics
import sys


def fit(xs, ys):
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


print("| file | N | wall median: intercept µs, slope µs/seq | CPU median: intercept µs, slope µs/seq |")
print("|---|---|---:|---:|")
for path in sys.argv[1:]:
    doc = json.loads(open(path).read())
    res = {r["streams"]: r for r in doc["results"]}
    for label, ns in (("all", sorted(res)), ("1, 32, 256", [1, 32, 256])):
        ns = [n for n in ns if n in res]
        wall = fit(ns, [statistics.median(res[n]["step_us"]) for n in ns])
        cpu = fit(ns, [statistics.median(res[n]["cpu_us"]) for n in ns])
        print(f"| {path.rsplit('/', 1)[-1]} | {label} | {wall[0]:.0f}, {wall[1]:.2f} | {cpu[0]:.0f}, {cpu[1]:.2f} |")

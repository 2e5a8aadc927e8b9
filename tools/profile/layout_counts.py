"""How the package's house looks, counted from the source (issue 38): files per folder, import
circles (module level, with the imports deferred into functions, with the TYPE_CHECKING ones),
upward imports, mypy errors over the whole package with nothing silenced, the largest files.

    python tools/profile/layout_counts.py [--out FILE] [--no-mypy]

The layers and the import graph are tests/test_layering.py's (one implementation). mypy runs with
pyproject's settings minus its `ignore_errors` overrides and over `slipstream/` whole, so the count
is the same before and after a module is un-silenced.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from slipstream import provenance as prov  # noqa: E402

_spec = importlib.util.spec_from_file_location("_layering", REPO / "tests" / "test_layering.py")
layering = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(layering)  # type: ignore[union-attr]


def mypy_errors() -> tuple[int, Counter]:
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]
    overrides = [o for o in conf.get("overrides", []) if not o.get("ignore_errors")]
    lines = ["[mypy]", f"python_version = {conf['python_version']}", "check_untyped_defs = True",
             "follow_imports = silent"]
    for o in overrides:
        mods = o["module"] if isinstance(o["module"], list) else [o["module"]]
        lines += [f"[mypy-{m}]" for m in mods[:1]]
        lines[-1] = "[mypy-" + ",".join(mods) + "]"
        lines += [f"{k} = {v}" for k, v in o.items() if k != "module"]
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "mypy.ini"
        cfg.write_text("\n".join(lines) + "\n")
        proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(cfg), "--cache-dir",
                               str(REPO / ".pytest_cache" / "mypy-all"), "slipstream"], cwd=REPO,
                              capture_output=True, text=True, timeout=900,
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    per_file: Counter = Counter()
    for line in proc.stdout.splitlines():
        m = re.match(r"(slipstream/\S+?\.py):\d+: error:", line)
        if m:
            per_file[m.group(1)] += 1
    return sum(per_file.values()), per_file


def duck_typing() -> list[str]:
    found = []
    pat = re.compile(r"getattr\((self\.)?(model|mcfg|model_config)\b|\.backend\s*==|== \"moondream\"")
    for path in sorted(layering.ROOT.rglob("*.py")):
        if "/models/" in str(path):
            continue  # a model may look at its own parts
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if pat.search(line):
                found.append(f"{path.relative_to(REPO)}:{i} {line.strip()}")
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-mypy", action="store_true")
    args = ap.parse_args()
    lines: list[str] = []
    say = lines.append
    pkg = layering.ROOT
    say("files per folder (.py and .c, __init__ included):")
    for d in sorted(p for p in [pkg, *pkg.rglob("*")] if p.is_dir() and p.name != "__pycache__"):
        n = sum(1 for f in d.iterdir() if f.suffix in (".py", ".c"))
        say(f"  {str(d.relative_to(pkg.parent)):40s} {n}")
    sizes = sorted(((len(f.read_text().splitlines()), f) for f in pkg.rglob("*") if f.suffix in (".py", ".c")),
                   reverse=True)
    say(f"files: {len(sizes)}   lines: {sum(s for s, _ in sizes)}")
    say("largest files (lines):")
    for n, f in sizes[:5]:
        say(f"  {n:5d} {f.relative_to(pkg.parent)}")
    runner = pkg / "runtime" / "model_runner.py"
    say(f"{runner.relative_to(pkg.parent)}: {len(runner.read_text().splitlines())} lines")
    tools = REPO / "tools"
    say("tools per room (scripts: .py and .sh):")
    for d in sorted([tools, *(p for p in tools.iterdir() if p.is_dir() and p.name != "__pycache__")]):
        n = sum(1 for f in d.iterdir() if f.suffix in (".py", ".sh"))
        say(f"  {str(d.relative_to(REPO)):40s} {n}")
    full = layering.graph()
    top = layering.graph(deferred=False)
    for label, g, typing in (("module level", top, False), ("with deferred imports", full, False),
                             ("with TYPE_CHECKING imports too", full, True)):
        cyc = layering.cycles(g, typing)
        say(f"import circles, {label}: {len(cyc)}" + "".join(f"\n  {' <-> '.join(c)}" for c in cyc))
    across, library = layering.private_reads_across_files()
    say(f"private names read across the package's files (x._name or `from m import _name`, defined in another "
        f"file): {len(across)}" + "".join(f"\n  {p}" for p in across))
    say(f"library privates read (torch._C and the like, defined nowhere in the package): {len(library)}"
        + "".join(f"\n  {p}" for p in library))
    duck = duck_typing()
    say(f"model duck typing (getattr on a model or its config, backend/architecture compared by name): {len(duck)}"
        + "".join(f"\n  {d}" for d in duck))
    up = layering.layering_violations(full)
    say(f"upward imports: {len(up)}" + "".join(f"\n  {u}" for u in up))
    if not args.no_mypy:
        total, per_file = mypy_errors()
        say(f"mypy errors over slipstream/ (nothing silenced): {total} in {len(per_file)} files")
        for f, n in per_file.most_common():
            say(f"  {n:4d} {f}")
    text = prov.header(prov.provenance()) + "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()

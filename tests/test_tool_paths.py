"""Every `tools/...` script that README.md, docs/*.md, the rooms' READMEs, the Makefile and the shell
scripts name exists, and each room's README indexes exactly the scripts in it (issue 53: a figure names
the script that made it; a script moved or removed takes its docs along). Raw outputs under
docs/results/ keep their commands as they were run and are not read. Reads files only."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(TOOLS.rglob("README.md")),
         ROOT / "Makefile", *sorted(TOOLS.rglob("*.sh"))]  # (the shell scripts run each other by path)
# (not after a word, `/` or `.`: `/tmp/x/tools/a.py` and llama.cpp's own tools/ are not ours)
PATH = re.compile(r"(?<![\w./-])tools/[\w./-]*\w\.(?:py|sh)\b")
SCRIPT = re.compile(r"^[\w-]+\.(?:py|sh)$")


def named(text: str) -> list[tuple[int, str]]:
    return [(n, p) for n, line in enumerate(text.splitlines(), 1) for p in PATH.findall(line)]


def missing(text: str) -> list[str]:
    return [f"line {n}: {p}" for n, p in named(text) if not (ROOT / p).is_file()]


def rooms() -> list[Path]:
    return sorted(p for p in TOOLS.iterdir() if p.is_dir() and p.name != "__pycache__")


def indexed(readme: Path) -> set[str]:
    """The scripts in the first column of a room README's table."""
    out = set()
    for line in readme.read_text().splitlines():
        if line.startswith("|"):
            first = line.split("|")[1].strip().strip("`")
            if SCRIPT.match(first):
                out.add(first)
    return out


def test_every_named_tool_exists():
    bad, count = [], 0
    for page in PAGES:
        text = page.read_text()
        count += len(named(text))
        bad += [f"{page.relative_to(ROOT)} {m}" for m in missing(text)]
    assert count > 150  # the pattern still finds the docs' paths
    assert not bad, "docs name tools that are not there (moved? then say where):\n  " + "\n  ".join(bad)


def test_no_script_outside_a_room():
    loose = sorted(p.name for p in TOOLS.iterdir() if p.is_file() and p.name != "README.md")
    assert not loose, f"tools/ holds rooms only (tools/README.md): {loose}"


def test_each_room_indexes_its_scripts():
    top = (TOOLS / "README.md").read_text()
    assert len(rooms()) >= 5
    for room in rooms():
        assert f"[{room.name}/]({room.name}/README.md)" in top, f"tools/README.md does not list {room.name}/"
        readme = room / "README.md"
        assert readme.is_file(), f"tools/{room.name}/ has no README.md"
        scripts = {p.name for p in room.iterdir() if p.suffix in (".py", ".sh")}
        listed = indexed(readme)
        assert listed == scripts, (f"tools/{room.name}/README.md: not indexed {sorted(scripts - listed)}, "
                                   f"indexed but absent {sorted(listed - scripts)}")


def test_a_missing_tool_is_caught():
    text = ("python tools/bench/bench_forward.py\n`tools/bench/no_such_bench.py --x`, tools/gpu/gpu_check.sh,\n"
            "/tmp/old/tools/no_such.py, llama.cpp's tools/server/no_such.sh")
    assert [p for _, p in named(text)] == ["tools/bench/bench_forward.py", "tools/bench/no_such_bench.py",
                                           "tools/gpu/gpu_check.sh", "tools/server/no_such.sh"]
    assert missing(text) == ["line 2: tools/bench/no_such_bench.py", "line 3: tools/server/no_such.sh"]

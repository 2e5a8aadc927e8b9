"""Every relative link in README.md and docs/*.md points at a file that exists, and every #anchor at a
heading of that file, slugged as GitHub slugs them (github-slugger: lower case, punctuation other than
`-` and `_` dropped, each space a `-`, a repeated heading's slug suffixed -1, -2, ...). Reads files only."""
from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
ANCHOR_TAG = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked (their brackets are code)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            out.append("")
            continue
        out.append("" if fenced else re.sub(r"`[^`]*`", lambda m: "`" + "x" * (len(m[0]) - 2) + "`", line))
    return out


def slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*\*|__|\*|`)", "", text)  # emphasis and code marks (not in the rendered text)
    text = text.strip().lower()
    keep = []
    for ch in text:
        cat = unicodedata.category(ch)
        if ch in " -" or cat[0] in "LMN" or cat == "Pc":
            keep.append(ch)
    return "".join(keep).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    raw = page.read_text(encoding="utf-8")
    original = raw.splitlines()
    for i, line in enumerate(prose(raw)):
        if not HEADING.match(line):
            continue
        base = slug(HEADING.match(original[i])[2])  # the original text: its code spans count
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(ANCHOR_TAG.findall(raw))
    return frozenset(out)


def links(page: Path):
    for number, line in enumerate(prose(page.read_text(encoding="utf-8")), 1):
        for m in LINK.finditer(line):
            target = m[1]
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            yield number, target


def broken(page: Path) -> list[str]:
    out = []
    for number, target in links(page):
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            out.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            out.append(f"{where} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    return out


def test_slugs_follow_github():
    assert slug("The persistent batch: a decode row costs the host one id") == \
        "the-persistent-batch-a-decode-row-costs-the-host-one-id"
    assert slug("Fewer, fatter kernels in the decode forward (issue 15)") == \
        "fewer-fatter-kernels-in-the-decode-forward-issue-15"
    assert slug("`Engine.stream` and *streams*") == "enginestream-and-streams"
    assert slug("Host-only cost per step (issue 14, before)") == "host-only-cost-per-step-issue-14-before"
    assert slug("snake_case names") == "snake_case-names"


def test_every_relative_link_and_anchor_resolves():
    problems = [p for page in PAGES for p in broken(page)]
    assert not problems, "\n".join(problems)

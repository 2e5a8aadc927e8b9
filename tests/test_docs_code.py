"""Every fenced ```python block of README.md and docs/*.md runs as written.

How blocks are run (each on its own, in a fresh namespace, as `__main__`, in this process):
  * The default model is swapped for `tiny-random` (2 layers, random weights) by a plain textual
    substitution, so the test takes seconds: `"smollm2-135m"` → `"tiny-random"` and
    `EngineConfig()` → `EngineConfig(model="tiny-random")` (SUBSTITUTIONS below). Nothing else
    in a block is changed; outputs of a random model are gibberish, so blocks must not depend on
    what the model says (a block may check `finish_reason` before parsing, as grammars.md does).
  * A block preceded by `<!-- doc-test: needs-server -->` talks to `slipstream serve` on
    http://127.0.0.1:8000: the test starts `slipstream serve --model tiny-random` on a free port
    and substitutes that address.
  * A block preceded by `<!-- skip-test: REASON -->` is not run (an interface listing, an
    excerpt); `test_skipped_blocks_are_listed` prints them so the list stays visible.
Blocks that import the example grammar plugin get `examples/grammar_plugin` on sys.path, as
`pip install -e examples/grammar_plugin` would provide.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBSTITUTIONS = [('"smollm2-135m"', '"tiny-random"'), ("EngineConfig()", 'EngineConfig(model="tiny-random")')]
SERVER = "http://127.0.0.1:8000"
MARKER = re.compile(r"<!--\s*(skip-test|doc-test):\s*(.*?)\s*-->")


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    code: str
    marker: tuple[str, str] | None  # ("skip-test", reason) | ("doc-test", "needs-server ...")

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            prev = next((ln for ln in reversed(lines[:i]) if ln.strip()), "")
            m = MARKER.search(prev)
            blocks.append(Block(path, i + 1, "\n".join(lines[i + 1:j]) + "\n", m.groups() if m else None))
            i = j
        i += 1
    return blocks


BLOCKS = [b for f in FILES for b in python_blocks(f)]
RUN = [b for b in BLOCKS if b.marker is None or b.marker[0] == "doc-test"]


def _source(block: Block, server_url: str | None) -> str:
    code = block.code
    for old, new in SUBSTITUTIONS:
        code = code.replace(old, new)
    if server_url is not None:
        code = code.replace(SERVER, server_url)
    return code


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from serve_util import ServeProc

    proc = ServeProc(tmp_path_factory.mktemp("serve"), "--model", "tiny-random")
    yield proc
    proc.stop()


@pytest.fixture
def logging_restored():
    """A block may configure logging (docs/logging.md does): put the loggers back afterwards."""
    import logging

    loggers = [logging.getLogger(), logging.getLogger("slipstream")]
    saved = [(lg, lg.level, list(lg.handlers)) for lg in loggers]
    yield
    for lg, level, handlers in saved:
        lg.setLevel(level)
        lg.handlers[:] = handlers


@pytest.fixture
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "grammar_plugin"))
    yield
    sys.modules.pop("slipstream_charset_grammar", None)


def test_blocks_were_found():
    assert len(BLOCKS) >= 5 and any(b.path.name == "README.md" for b in RUN)


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_block_runs(block: Block, request, plugin_on_path, logging_restored, capsys):
    needs_server = block.marker is not None and block.marker[1].startswith("needs-server")
    url = request.getfixturevalue("server").url if needs_server else None
    code = compile(_source(block, url), block.id, "exec")
    exec(code, {"__name__": "__main__"})  # noqa: S102 - the docs' own code, the point of the test
    capsys.readouterr()


def test_skipped_blocks_are_listed():
    skipped = [f"{b.id}: {b.marker[1]}" for b in BLOCKS if b.marker and b.marker[0] == "skip-test"]
    print("python blocks not run:\n  " + "\n  ".join(skipped))
    assert all(b.marker[1] for b in BLOCKS if b.marker)  # every skip says why


def test_substitutions_only_touch_the_model():
    code = 'EngineConfig(model="smollm2-135m", device="cpu")\nEngineConfig()\n'
    block = Block(ROOT / "README.md", 1, code, None)
    assert _source(block, None) == 'EngineConfig(model="tiny-random", device="cpu")\nEngineConfig(model="tiny-random")\n'

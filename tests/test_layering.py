"""The layers go one way, read from the source (ast, nothing imported): api -> scheduler -> runtime ->
grammar -> models, with a few shared leaf modules every layer may use; and no import circles.

Layers, highest first (a module may import its own layer and the ones below, never one above):
  api        slipstream/api, serve, commands and the top-level modules (params.py is the API's
             config, outputs.py its result types, cli.py, bench*.py, metrics.py, trace.py, ...)
  scheduler  slipstream/scheduler (no torch: it plans on the host)
  runtime    slipstream/runtime
  grammar    slipstream/grammar (the runtime packs its bitmasks; it reads the tokenizer of models/)
  models     slipstream/models
Shared leaves, importable from every layer and importing only each other: errors.py, intmath.py,
validate.py, logging_setup.py, plugins.py.

Every import counts, for the layers and for circles: top level, inside a function, under `if
TYPE_CHECKING` (an upward annotation is still an upward dependency; an import deferred into a
function, or kept to annotations, hides a circle, it does not remove it).
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "slipstream"
SHARED = {"slipstream.errors", "slipstream.intmath", "slipstream.validate", "slipstream.logging_setup",
          "slipstream.plugins", "slipstream.faults"}  # (faults: the injection points every layer checks; imports nothing)
RANK = {"models": 0, "grammar": 1, "runtime": 2, "speculation": 2, "scheduler": 3}
API = 4
NO_TORCH = ("slipstream.scheduler", "slipstream.speculation.policy")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports(path: Path, known: set[str], deferred: bool = True) -> list[tuple[str, bool]]:
    """(imported module, under TYPE_CHECKING) for every import in the file; `from pkg import mod`
    names the submodule when it is one. `deferred=False` leaves out the imports inside functions."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend((a.name, typing_only) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                for a in child.names:
                    sub = f"{mod}.{a.name}"
                    out.append((sub if sub in known else mod, typing_only))
            elif deferred or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, typing_only or (isinstance(child, ast.If) and _is_type_checking(child)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def graph(deferred: bool = True) -> dict[str, list[tuple[str, bool]]]:
    mods = modules()
    return {m: imports(p, set(mods), deferred) for m, p in mods.items()}


def rank(module: str) -> int | None:
    """None for the shared leaves."""
    if module in SHARED:
        return None
    parts = module.split(".")
    return RANK.get(parts[1], API) if len(parts) > 1 else API


def layering_violations(g: dict[str, list[tuple[str, bool]]]) -> list[str]:
    bad = []
    for mod, deps in g.items():
        for dep, _ in deps:
            if not dep.startswith("slipstream") or dep == mod:
                if dep.split(".")[0] == "torch" and mod.startswith(NO_TORCH):
                    bad.append(f"{mod} imports torch")
                continue
            r, d = rank(mod), rank(dep)
            if r is None and d is not None:
                bad.append(f"{mod} (shared) imports {dep}")
            elif r is not None and d is not None and d > r:
                bad.append(f"{mod} imports {dep} (a higher layer)")
    return sorted(set(bad))


def cycles(g: dict[str, list[tuple[str, bool]]], typing: bool = True) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan); `typing=False` leaves the
    TYPE_CHECKING imports out."""
    edges = {m: sorted({d for d, typing_only in deps if (typing or not typing_only) and d in g and d != m})
             for m, deps in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def _private_names(tree: ast.AST) -> set[str]:
    """`_name`s a file defines: functions, classes, attributes it assigns (self._x, x._x, module and
    class level), annotated fields and __slots__ entries."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out.add(n.id)
                    elif isinstance(n, ast.Attribute):
                        out.add(n.attr)
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                    for t in node.targets):
                out.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                           and isinstance(c.value, str))
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def private_reads_across_files() -> tuple[list[str], list[str]]:
    """(across the package's files, of libraries): `x._name` with x not self, cls or super(), and
    `from m import _name`. Across files: `_name` is defined in another file of the package and not
    in this one, so this file reaches into another room's privates (what a public method is for).
    Of libraries: defined nowhere in the package (torch._C and the like), counted apart."""
    mods = modules()
    trees = {p: ast.parse(p.read_text(), str(p)) for p in mods.values()}
    defined = {p: _private_names(t) for p, t in trees.items()}
    everywhere: set[str] = set().union(*defined.values())
    across, library = [], []
    for path, tree in trees.items():
        own = defined[path]
        for node in ast.walk(tree):
            names: list[tuple[str, int]] = []
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                    and not (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                             and node.value.func.id == "super")):
                names.append((node.attr, node.lineno))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("slipstream"):
                names += [(a.name, node.lineno) for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
            for name, line in names:
                where = f"{path.relative_to(ROOT.parent)}:{line} .{name}"
                if name in everywhere and name not in own:
                    across.append(where)
                elif name not in everywhere:
                    library.append(where)
    return sorted(across), sorted(library)


def test_no_file_reads_another_files_privates():
    """A room is used through its public names: a `_name` defined in one file of the package is read
    only in that file (issue 53; tools/layout_counts.py reports the same count)."""
    assert private_reads_across_files()[0] == []


def test_the_private_check_sees_a_reach_across_files(tmp_path):
    """The check can fail: a file that calls another file's private method is found."""
    pkg = tmp_path / "slipstream"
    (pkg / "a").mkdir(parents=True)
    (pkg / "a" / "runner.py").write_text("class R:\n    def _free(self):\n        return 1\n")
    (pkg / "a" / "spec.py").write_text("def launch(r):\n    return r._free()\n\n\ndef own(x):\n    return x._mine\n"
                                       "\n\nclass T:\n    _mine = 0\n")
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        across, library = private_reads_across_files()
    finally:
        ROOT = saved
    assert across == ["slipstream/a/spec.py:2 ._free"] and library == []


def test_no_module_imports_a_higher_layer():
    assert layering_violations(graph()) == []


def test_no_import_circles():
    assert cycles(graph()) == []


def test_the_checks_see_what_they_check():
    g = graph()
    assert ("slipstream.runtime.batch", False) in g["slipstream.scheduler.step"]
    assert ("slipstream.faults", True) in g["slipstream.runtime.model_runner"]  # a TYPE_CHECKING import
    g["slipstream.runtime.devices.cuda_device"].append(("slipstream.params", False))  # the old upward import
    g["slipstream.scheduler.planner"].append(("torch", False))
    assert layering_violations(g) == ["slipstream.runtime.devices.cuda_device imports slipstream.params (a higher layer)",
                                      "slipstream.scheduler.planner imports torch"]
    g["slipstream.models.kernels.rotary"].append(("slipstream.models.llama.model", False))  # deferred in a function counts
    (circle,) = cycles(g)
    assert {"slipstream.models.llama.model", "slipstream.models.kernels.rotary"} <= set(circle)


FAMILIES = ("slipstream.models.llama", "slipstream.models.idefics3", "slipstream.models.moondream",
            "slipstream.models.registry")


def test_kernels_and_tokenizers_import_no_model_family():
    """models/kernels and models/tokenizers are rooms a family uses, never the other way round."""
    g = graph()
    bad = [f"{m} imports {d}" for m, deps in g.items() if m.startswith(("slipstream.models.kernels",
                                                                          "slipstream.models.tokenizers"))
           for d, _ in deps if d.startswith(FAMILIES)]
    assert bad == []


def test_a_model_is_asked_through_its_protocol():
    """Outside models/, no probing of a model with getattr/hasattr and no comparing its backend by
    name: the runner and the API ask what models/base.py's Model protocol names."""
    import re

    probe = re.compile(r"\b(getattr|hasattr)\((self\.)?model\b|\bmodel\.backend\s*==")
    bad = [f"{p.relative_to(ROOT.parent)}:{i}" for p in sorted(ROOT.rglob("*.py")) if "models" not in p.parts
           for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert bad == []

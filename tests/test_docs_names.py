"""docs/architecture.md cites only files and code names that exist (issue 28, "one name per meaning").

Every path it mentions (`slipstream/...`, `runtime/x.py`, `tests/...`, `tools/...`, `docs/...`, a
relative `.md` link) must exist. Every backticked code name must be defined under slipstream/,
read with `ast` (nothing is imported):
  * `Name`            a class, function or module-level name, or (snake_case) any attribute, field,
                      method or parameter-free name defined anywhere (`finished`, `inflight_refs`);
  * `Owner.attr`      `attr` defined on class `Owner` (its body, `self.attr =` in its methods, or a
                      base class), or at module level of module `Owner` (`chunking.next_chunk`);
  * `path/module.Name` `Name` defined in that module;
  * `A.b/c`           shorthand for `A.b` and `A.c`; a call `f(x=...)` checks `f` and its keywords.
In an expression or statement (`inflight_refs == 0`, `batch_invariant=False`) its multi-word names
are checked; what is left (CLI flags, arrows, literals) is skipped. Names from outside slipstream are listed in ALLOWED with the reason.
"""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
PKG = ROOT / "slipstream"

ALLOWED = {
    "gc.freeze": "the standard library's gc module",
}

IDENT = r"[A-Za-z_]\w*"
NAME = re.compile(rf"^{IDENT}(\.{IDENT})*(/{IDENT})*(\(\))?$")
MODULE_NAME = re.compile(rf"^((?:{IDENT}/)+{IDENT})\.({IDENT}(?:\.{IDENT})?)$")
PATH = re.compile(r"(?<![\w/.])((?:slipstream|runtime|scheduler|models|api|grammar|serve|tests|tools|docs)/[\w./*-]*\w)")
LINK = re.compile(r"\]\(([\w./-]+\.md)\)")


class Index:
    """What slipstream/ defines, by name."""

    def __init__(self, root: Path):
        self.classes: dict[str, list[ast.ClassDef]] = defaultdict(list)
        self.members: dict[int, set[str]] = defaultdict(set)  # id(ClassDef) -> names
        self.modules: dict[str, set[str]] = defaultdict(set)  # module stem -> module-level names
        self.module_paths: dict[str, set[str]] = {}  # "runtime/batch" -> module-level names
        self.everything: set[str] = set()
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            top = self._module_names(tree)
            self.modules[path.stem] |= top
            self.module_paths[path.relative_to(root).with_suffix("").as_posix()] = top
            self.everything |= top
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.classes[node.name].append(node)
                    names = self._class_names(node)
                    self.members[id(node)] = names
                    self.everything |= names | {node.name}
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.everything.add(node.name)

    @staticmethod
    def _targets(node: ast.AST) -> list[ast.expr]:
        if isinstance(node, ast.Assign):
            out: list[ast.expr] = []
            for t in node.targets:
                out += list(t.elts) if isinstance(t, ast.Tuple) else [t]
            return out
        if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            return [node.target]
        return []

    def _module_names(self, tree: ast.Module) -> set[str]:
        names = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            names |= {t.id for t in self._targets(node) if isinstance(t, ast.Name)}
            if isinstance(node, ast.If):  # definitions under `if triton is not None:` and the like
                names |= self._module_names(ast.Module(body=node.body, type_ignores=[]))
        return names

    def _class_names(self, cls: ast.ClassDef) -> set[str]:
        names = set()
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            names |= {t.id for t in self._targets(node) if isinstance(t, ast.Name)}
        for node in ast.walk(cls):
            for t in self._targets(node):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
        return names

    def class_has(self, owner: str, attr: str, seen: frozenset[str] = frozenset()) -> bool:
        for cls in self.classes.get(owner, []):
            if attr in self.members[id(cls)]:
                return True
            for base in cls.bases:
                name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", None)
                if name and name not in seen and self.class_has(name, attr, seen | {owner}):
                    return True
        return False

    def resolves(self, name: str) -> bool:
        head, _, rest = name.partition(".")
        if not rest:
            return name in self.everything
        attr, _, deeper = rest.partition(".")
        if deeper:  # `A.b.c`: b must be on A; c anywhere (its type is not tracked)
            return self.resolves(f"{head}.{attr}") and deeper.split(".")[-1] in self.everything
        return self.class_has(head, attr) or attr in self.modules.get(head, set())


def code_spans(text: str) -> list[tuple[int, str]]:
    """(line, content) of every inline code span outside fenced blocks."""
    spans, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            spans += [(n, m) for m in re.findall(r"`([^`\n]+)`", line)]
    return spans


def names_in(span: str) -> list[str] | None:
    """The code names a span cites, [] for a path, None when it is not a name (an expression)."""
    span = span.strip()
    if span in ALLOWED or span in ("None", "True", "False"):
        return []
    if span.endswith((".py", ".md")) or ("/" in span and MODULE_NAME.match(span) is None and "." not in span):
        return []  # a path: checked by test_cited_paths_exist
    try:
        expr = ast.parse(span, mode="eval").body
    except SyntaxError:
        expr = None
    if isinstance(expr, ast.Call) and isinstance(expr.func, (ast.Name, ast.Attribute)) and span[0].isalpha():
        func = ast.unparse(expr.func)
        return [func] + [f"{func}.{k.arg}" for k in expr.keywords if k.arg]
    if NAME.match(span) is None:
        try:  # an expression or statement (`inflight_refs == 0`, `batch_invariant=False`): its
            # multi-word names (`page` or `offset` alone are prose)
            tree = ast.parse(span, mode="exec")
        except SyntaxError:
            return None
        named = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and "_" in n.id.strip("_")})
        return named or None
    span = span.removesuffix("()")
    first, *more = span.split("/")
    owner = first.rpartition(".")[0]
    return [first] + [f"{owner}.{m}" if owner else m for m in more]


def unresolved(text: str, index: Index) -> list[str]:
    bad = []
    for line, span in code_spans(text):
        m = None if span.endswith((".py", ".md")) else MODULE_NAME.match(span)
        if m:
            module, attr = m.group(1), m.group(2).split(".")[0]
            module = module.removeprefix("slipstream/")
            if attr not in index.module_paths.get(module, set()):
                bad.append(f"line {line}: `{span}`")
            continue
        for name in names_in(span) or []:
            if name not in ALLOWED and not index.resolves(name):
                bad.append(f"line {line}: `{name}`" + (f" (in `{span}`)" if name != span else ""))
    return bad


def cited_paths(text: str) -> list[tuple[int, str]]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        out += [(n, p) for p in PATH.findall(line)] + [(n, "docs/" + p) for p in LINK.findall(line)]
    return out


def exists(path: str) -> bool:
    m = None if path.endswith((".py", ".md")) else MODULE_NAME.match(path)
    if m:  # `scheduler/output_sink.OutputSink`: the module's file (the name is test_cited_names')
        path = m.group(1)
    for base in (ROOT, PKG):
        if "*" in path:
            if any(base.glob(path)):
                return True
        elif (base / path).exists() or (base / (path + ".py")).exists():
            return True
    return False


def test_cited_paths_exist():
    text = DOC.read_text()
    paths = cited_paths(text)
    assert len(paths) > 20
    missing = [f"line {n}: {p}" for n, p in paths if not exists(p)]
    assert not missing, "docs/architecture.md cites missing files:\n  " + "\n  ".join(missing)


def test_cited_names_are_defined():
    index = Index(PKG)
    text = DOC.read_text()
    checked = [s for _, s in code_spans(text) if names_in(s)]
    assert len(checked) > 50  # the parser still finds the doc's names
    bad = unresolved(text, index)
    assert not bad, ("docs/architecture.md cites names slipstream/ does not define (renamed? then rename "
                     "the doc too; outside slipstream? then add to ALLOWED with a reason):\n  " + "\n  ".join(bad))


def test_a_stale_name_is_caught():
    index = Index(PKG)
    stale = ("`DecodeSlot.acquire` `Sequence.finalized` `RowTables.token` `chunking.no_such_part` "
             "`runtime/batch.NoSuchType` `EngineConfig(no_such_field=1)` `carry_on_device`")
    assert len(unresolved(stale, index)) == 7
    assert unresolved("`StepSlot.acquire/release` `Sequence.finished` `runtime/batch.ForwardInput`", index) == []

"""The package layout matches docs/map.md: every module of detcomm/ is on the map (and every entry exists), the
import graph has no cycle, and no module imports from a layer above its own. Imports are read from the source
with ast (no module is imported), every one counted: lazy imports inside functions and ``if TYPE_CHECKING:``
blocks too (a type-only import is still a dependency of the module's meaning, and a circle through one is a
circle). Negative controls: the same checkers on synthetic graphs and sources must report the cycle, the upward
edge, the module missing from the map, the lazy import and the type-only one."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "detcomm"
MAP = ROOT / "docs" / "map.md"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(source: str, module: str, *, is_package: bool) -> set[tuple[str, str]]:
    """Every import statement of ``source``, wherever it stands (a function, an ``if TYPE_CHECKING:`` block), as
    (module, name) pairs: ``from a import b`` gives ("a", "b") (b a submodule or an attribute of a), ``import a.b``
    gives ("a.b", ""). Relative imports are resolved against ``module``."""
    found: set[tuple[str, str]] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update((a.name, "") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.update((base, a.name) for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports: ``from a import b`` is an edge to a.b where that is a module,
    else to a; ``import a.b`` to the nearest module enclosing a.b."""
    files = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        edges = set()
        for base, name in imported_names(path.read_text(), mod, is_package=path.name == "__init__.py"):
            target = f"{base}.{name}" if f"{base}.{name}" in files else base
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != mod:
                edges.add(target)
        graph[mod] = edges
    return graph


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def read_map(text: str) -> tuple[dict[str, int], list[str]]:
    """(package entry -> layer number, the other entries) from docs/map.md: ``### N. name`` headings and
    ``- `path`:`` items."""
    layers: dict[str, int] = {}
    others: list[str] = []
    layer = None
    for line in text.splitlines():
        if m := re.match(r"### (\d+)\. ", line):
            layer = int(m.group(1))
        elif line.startswith("## "):
            layer = None
        elif m := re.match(r"- `([^`]+)`:", line):
            if layer is None:
                others.append(m.group(1))
            else:
                layers[m.group(1)] = layer
    return layers, others


def layer_of(module: str, entries: Mapping[str, int]) -> int | None:
    """The layer of the map entry that covers ``module``: its file, or the nearest folder above it."""
    parts = module.split(".")
    for path in (f"{'/'.join(parts)}.py", f"{'/'.join(parts)}/__init__.py"):
        if path in entries:
            return entries[path]
    for n in range(len(parts), 0, -1):
        if (folder := "/".join(parts[:n]) + "/") in entries:
            return entries[folder]
    return None


def unmapped(modules: Iterable[str], entries: Mapping[str, int]) -> list[str]:
    return sorted(m for m in modules if layer_of(m, entries) is None)


def upward(graph: Mapping[str, Iterable[str]], entries: Mapping[str, int]) -> list[str]:
    out = []
    for a, targets in graph.items():
        for b in targets:
            la, lb = layer_of(a, entries), layer_of(b, entries)
            if la is not None and lb is not None and lb > la:
                out.append(f"{a} (layer {la}) imports {b} (layer {lb})")
    return sorted(out)


# -- the package ---------------------------------------------------------------------------------------------------
@functools.cache
def _package_graph() -> dict[str, set[str]]:
    return import_graph(PACKAGE)


def test_map_lists_every_module_and_only_what_exists() -> None:
    entries, others = read_map(MAP.read_text())
    assert len(set(entries.values())) >= 8, entries
    assert unmapped(_package_graph(), entries) == [], "add these modules to docs/map.md under their layer"
    missing = [p for p in [*entries, *others] if not (ROOT / p).exists()]
    assert missing == [], f"docs/map.md names paths that do not exist: {missing}"


def test_no_import_cycles() -> None:
    assert cycles(_package_graph()) == []


def test_no_module_imports_from_a_higher_layer() -> None:
    entries, _ = read_map(MAP.read_text())
    assert upward(_package_graph(), entries) == [], "move the code to the layer that owns it (docs/map.md)"


def test_spec_links_the_map_instead_of_repeating_it() -> None:
    spec = (ROOT / "docs" / "spec.md").read_text()
    assert "docs/map.md" in spec and "detcomm/route.py" not in spec.partition("## Map of the code")[2]


# -- negative controls: the checkers see what they must refuse ----------------------------------------------------
def test_checkers_report_a_cycle_an_upward_edge_and_an_unmapped_module() -> None:
    entries = {"p/a.py": 1, "p/b.py": 2, "p/c/": 2}
    acyclic = {"p.a": set(), "p.b": {"p.a", "p.c.x"}, "p.c.x": {"p.a"}}
    assert cycles(acyclic) == [] and upward(acyclic, entries) == [] and unmapped(acyclic, entries) == []
    assert cycles({**acyclic, "p.a": {"p.c.x"}}) == [["p.a", "p.c.x"]]
    assert upward({**acyclic, "p.a": {"p.b"}}, entries) == ["p.a (layer 1) imports p.b (layer 2)"]
    assert unmapped([*acyclic, "p.d"], entries) == ["p.d"]


def test_imports_are_read_lazy_and_type_checking_included() -> None:
    source = ("import typing\nfrom typing import TYPE_CHECKING\nfrom . import b\nif TYPE_CHECKING:\n"
              "    from .c import C\nif typing.TYPE_CHECKING:\n    import p.d\n"
              "def f():\n    from ..top import g\n    return g\n")
    names = imported_names(source, "p.sub.a", is_package=False)
    assert {("p.sub", "b"), ("p.top", "g"), ("p.sub.c", "C"), ("p.d", "")} <= names, names


def test_a_cycle_through_a_type_checking_import_is_reported(tmp_path) -> None:
    """The circle the layout once hid (norm -> route -> admission -> route): a runtime import one way, a type-only
    import back, planted in a synthetic package, is a cycle and an upward edge."""
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .high import H\n")
    (pkg / "high.py").write_text("from .low import L\n")
    graph = import_graph(pkg)
    assert graph["p.low"] == {"p.high"} and graph["p.high"] == {"p.low"}, graph
    assert cycles(graph) == [["p.high", "p.low"]]
    assert upward(graph, {"p/low.py": 1, "p/high.py": 2}) == ["p.low (layer 1) imports p.high (layer 2)"]


def test_the_checker_sees_the_real_packages_layers() -> None:
    """The real graph is not vacuous: the communicator reaches every route, and a planted upward import (the fold
    importing the communicator) is reported."""
    entries, _ = read_map(MAP.read_text())
    graph = _package_graph()
    assert {"detcomm.route_impls", "detcomm.workspace", "detcomm.numerics.fold"} <= graph["detcomm.comm"]
    planted = {**graph, "detcomm.numerics.fold": graph["detcomm.numerics.fold"] | {"detcomm.comm"}}
    assert upward(planted, entries) == ["detcomm.numerics.fold (layer 3) imports detcomm.comm (layer 6)"]
    assert cycles(planted) != []


def test_no_test_module_imports_conftest_by_name() -> None:
    """tests/ and tests/gpu/ each have a conftest.py, so `from conftest import ...` finds whichever pytest imported
    last in a whole-suite run (shared helpers live in tests/clusters.py); the check itself is tried on a planted
    line (the negative control)."""
    pattern = re.compile(r"^\s*(from conftest import|import conftest\b)", re.M)
    assert pattern.search("def f():\n    from conftest import get_cluster\n")
    tests = Path(__file__).resolve().parent
    offenders = [str(p.relative_to(tests)) for p in tests.rglob("*.py") if pattern.search(p.read_text())]
    assert not offenders, f"import shared test helpers from tests/clusters.py, not conftest: {offenders}"


def _same_basenames(paths: list[Path]) -> list[str]:
    seen: dict[str, Path] = {}
    clashes = []
    for p in sorted(paths):
        if p.name in seen:
            clashes.append(f"{seen[p.name]} and {p}")
        seen.setdefault(p.name, p)
    return clashes


def test_test_modules_have_unique_basenames() -> None:
    """tests/ and tests/gpu/ are not packages, so pytest imports each test module by its basename: two files of one
    name stop the whole-suite collection ("import file mismatch"), which a run of either file alone never shows.
    The check itself is tried on a planted pair (the negative control)."""
    assert _same_basenames([Path("tests/test_a.py"), Path("tests/gpu/test_a.py")]) == [
        "tests/gpu/test_a.py and tests/test_a.py"]
    tests = Path(__file__).resolve().parent
    modules = [p.relative_to(tests) for p in tests.rglob("test_*.py")]
    assert not _same_basenames(modules), f"rename one of each pair: {_same_basenames(modules)}"


# The house's size limits (issue 41): the three modules every change passes through, and every module's docstring.
SIZE_LIMITS = {"detcomm/workspace/workspace.py": 500, "detcomm/comm.py": 600, "detcomm/route.py": 450}
DOCSTRING_LINES = 30


def docstring_lines(source: str) -> int:
    """Lines of a module's docstring, its quotes included (0 without one)."""
    tree = ast.parse(source)
    first = tree.body[0] if tree.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)):
        return 0
    assert first.end_lineno is not None
    return first.end_lineno - first.lineno + 1


def test_the_houses_size_limits() -> None:
    over = {p: n for p, limit in SIZE_LIMITS.items() if (n := len((ROOT / p).read_text().splitlines())) > limit}
    assert not over, f"over their line limits {SIZE_LIMITS}: {over}"
    long = {str(p.relative_to(ROOT)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := docstring_lines(p.read_text())) > DOCSTRING_LINES}
    assert not long, f"module docstrings over {DOCSTRING_LINES} lines (move the design to docs/): {long}"


def test_docstring_lines_counts_the_quotes() -> None:
    """The negative control: a 31-line docstring is counted as 31, a file without one as 0."""
    assert docstring_lines('"""' + "\n" * 30 + '"""\nx = 1\n') == 31
    assert docstring_lines("x = 1\n") == 0

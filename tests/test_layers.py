"""The package's layers hold: imports only go down, no import circles, no reaching into another
module's private names.

Layers, bottom to top: core < model < methods < serving < triton < (openai) < cli. A module may
import its own layer and those below it. Every import counts, wherever it is written (top level,
inside a function, under TYPE_CHECKING): a function-local import is still a dependency, only a
deferred one. specserve/triton/model_repository/*/1/model.py are Triton adapters (package data,
never imported) at the very top: they may import any layer, but what they import must exist.

The checker reads source with `ast` (nothing is imported), so it runs in a second and needs no
Triton, no torch.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "specserve"
# Bottom to top. `openai` (an OpenAI-compatible front end) has no package yet; its place is kept.
LAYERS = ("core", "model", "methods", "serving", "triton", "openai", "cli")

# Violations that other work in progress removes; the lead empties these sets when it lands.
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()
KNOWN_PRIVATE: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


ADAPTERS = f"{PACKAGE}/triton/model_repository"


def package_modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))
            if not p.is_relative_to(root / ADAPTERS)}


def imports_of(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> tuple[list[Edge], list[str]]:
    """Every import of the package in `tree` → (edges to its modules, imports naming no module)."""
    edges, unresolved = [], []
    here = module.split(".") if is_package else module.split(".")[:-1]

    def add(target: str, line: int) -> None:
        if target != PACKAGE and not target.startswith(PACKAGE + "."):
            return
        if target not in known:
            unresolved.append(f"{target} (line {line})")
        elif target != module:
            edges.append(Edge(module, target, line))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # `from pkg import mod` depends on pkg.mod; `from mod import name` on mod.
                sub = f"{source}.{alias.name}"
                add(sub if sub in known else source, node.lineno)
    return edges, unresolved


def private_reaches(tree: ast.AST, module: str) -> set[tuple[str, str]]:
    """(module, what) for each use of another module's private name: `from m import _x`, or a call
    `obj._x(...)` on an object other than self / cls / super()."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.add((module, f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, base = node.func.attr, node.func.value
            if not attr.startswith("_") or attr.startswith("__"):
                continue
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            if _is_third_party(base, tree):
                continue
            found.add((module, ast.unparse(node.func)))
    return found


def _is_third_party(expr: ast.expr, tree: ast.AST) -> bool:
    """True when the expression's root name is an imported module outside the package (torch.…)."""
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == expr.id:
                    return not alias.name.startswith(PACKAGE)
    return False


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == PACKAGE and parts[1] in LAYERS else None


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) for every import of a higher layer."""
    bad = set()
    for importer, targets in graph.items():
        low = layer_of(importer)
        for imported in targets:
            high = layer_of(imported)
            if low is not None and high is not None and LAYERS.index(high) > LAYERS.index(low):
                bad.add((importer, imported))
    return bad


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle [a, b, …, a] per strongly connected group of modules (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return [_cycle_in(set(g), graph) for g in groups]


def _cycle_in(group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A concrete closed path through a strongly connected group, from its first module."""
    start = min(group)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to `start`
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [*reversed(path), start]
                if w in group and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {sorted(group)}")


def problems(graph: dict[str, set[str]], known: set[tuple[str, str]] = frozenset()) -> list[str]:
    """What the layer rules find in an import graph, as messages (empty: the graph is clean)."""
    out = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)}), a higher layer"
           for a, b in sorted(upward_imports(graph) - known)]
    out += ["import cycle: " + " -> ".join(c) for c in import_cycles(graph)]
    return out


@dataclass
class Scan:
    graph: dict[str, set[str]]
    edges: list[Edge]
    unresolved: list[str]
    private: set[tuple[str, str]]


def scan(root: Path = ROOT) -> Scan:
    modules = package_modules(root)
    known = set(modules)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    edges, unresolved, private = [], [], set()
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        found, missing = imports_of(tree, module, path.name == "__init__.py", known)
        graph[module] |= {e.imported for e in found}
        edges += found
        unresolved += [f"{path.relative_to(root)}: {m}" for m in missing]
        private |= private_reaches(tree, module)
    for path in sorted(root.glob(f"{ADAPTERS}/*/1/model.py")):
        # Top of the stack: any layer is fine, but a stale import after a move is not.
        _, missing = imports_of(ast.parse(path.read_text(), str(path)), "model_repository", False, known)
        unresolved += [f"{path.relative_to(root)}: {m}" for m in missing]
    return Scan(graph, edges, unresolved, private)


@pytest.fixture(scope="module")
def found() -> Scan:
    return scan()


def test_the_adapters_are_where_the_checker_looks():
    assert sorted(ROOT.glob(f"{ADAPTERS}/*/1/model.py")), f"no Triton adapters under {ADAPTERS}"


def test_every_package_module_belongs_to_a_layer(found):
    loose = [m for m in found.graph if m != PACKAGE and layer_of(m) is None]
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"


def test_imports_only_go_down(found):
    bad = upward_imports(found.graph) - KNOWN_VIOLATIONS
    where = {(e.importer, e.imported): e.line for e in found.edges}
    assert not bad, "\n".join(f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)}) at line "
                              f"{where[a, b]}: a higher layer" for a, b in sorted(bad))


def test_no_import_cycles(found):
    cycles = import_cycles(found.graph)
    assert not cycles, "\n".join("import cycle: " + " -> ".join(c) for c in cycles)


def test_known_violations_still_exist(found):
    """A fixed violation must leave KNOWN_VIOLATIONS / KNOWN_PRIVATE, so it cannot come back."""
    stale = (KNOWN_VIOLATIONS - upward_imports(found.graph)) | (KNOWN_PRIVATE - found.private)
    assert not stale, f"fixed, remove from the known sets in tests/test_layers.py: {sorted(stale)}"


def test_no_module_reaches_into_another_modules_private_names(found):
    bad = found.private - KNOWN_PRIVATE
    assert not bad, f"private names used from outside their module: {sorted(bad)}"


def test_every_import_of_the_package_names_an_existing_module(found):
    assert not found.unresolved, "imports of modules that do not exist:\n" + "\n".join(found.unresolved)


# -- the checker itself ------------------------------------------------------------------------------

def test_the_checker_fails_a_graph_with_an_upward_import_and_a_cycle():
    graph = {
        "specserve.core.engine": {"specserve.core.kv_cache"},
        "specserve.core.kv_cache": {"specserve.serving.build"},   # upward, and closes a circle
        "specserve.serving.build": {"specserve.core.engine", "specserve.model.transformer"},
        "specserve.model.transformer": {"specserve.core.kv_cache"},
        "specserve.cli.main": {"specserve.serving.build"},        # downward: fine
    }
    found = problems(graph)
    assert found[0] == ("specserve.core.kv_cache (layer core) imports specserve.serving.build (layer serving), "
                        "a higher layer")
    assert found[1:] == ["import cycle: specserve.core.engine -> specserve.core.kv_cache -> "
                         "specserve.serving.build -> specserve.core.engine"]
    assert problems(graph, known={("specserve.core.kv_cache", "specserve.serving.build")}) == found[1:]
    del graph["specserve.core.kv_cache"]
    assert problems(graph) == []


def test_the_checker_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / PACKAGE
    for name in ("core", "serving", "triton"):
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "triton" / "bls.py").write_text("def _call(): ...\n")
    (pkg / "serving" / "build.py").write_text("from . import params\n")
    (pkg / "serving" / "params.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..serving import build\n")
    (pkg / "core" / "engine.py").write_text(
        "def f(engine):\n    from specserve.triton import bls\n    import specserve.serving.nothing\n"
        "    engine._forward()\n    return bls._call()\n")
    got = scan(tmp_path)
    assert got.graph["specserve.core.engine"] == {"specserve.triton.bls"}
    assert got.unresolved == ["specserve/core/engine.py: specserve.serving.nothing (line 3)"]
    assert import_cycles(got.graph) == [["specserve.serving.build", "specserve.serving.params",
                                         "specserve.serving.build"]]
    assert got.private == {("specserve.core.engine", "engine._forward"), ("specserve.core.engine", "bls._call")}

"""The package's subpackages import each other in one direction: no circle, at module level or
inside functions (TYPE_CHECKING imports aside), found by reading the sources with ast."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import infer8

ROOT = Path(infer8.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """Return the unit a module belongs to: infer8.<subpackage or top-level module>."""
    return ".".join(module.split(".")[:2])


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """Return the infer8 modules a source imports anywhere but under `if TYPE_CHECKING:`."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith("infer8"))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                if child.module.startswith("infer8"):
                    for alias in child.names:  # `from infer8.x import y`: the module x.y if any
                        sub = f"{child.module}.{alias.name}"
                        found.add(sub if sub in modules else child.module)
            visit(child)

    visit(tree)
    return found


def _unit_graph() -> dict[str, dict[str, list[str]]]:
    """Return unit -> unit it imports -> the module-level imports that make the edge."""
    sources = {_module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(sources)
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name, path in sources.items():
        for target in _imports(ast.parse(path.read_text(), str(path)), modules):
            a, b = _unit(name), _unit(target)
            if a != b:
                graph[a][b].append(f"{name} -> {target}")
    return graph


def _cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Return the strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in list(graph):
        if v not in index:
            connect(v)
    return components


def test_no_import_circle_among_subpackages() -> None:
    graph = _unit_graph()
    assert len(graph) > 10, "the scan found the package's imports"
    problems = []
    for component in _cycles(graph):
        edges = [e for a in component for b in component if b in graph[a] for e in graph[a][b][:3]]
        problems.append(f"{' <-> '.join(component)}:\n    " + "\n    ".join(edges))
    assert not problems, "import circles:\n" + "\n".join(problems)


def test_the_scan_sees_a_circle() -> None:
    """The check itself: two units importing each other, one inside a function, are a circle."""
    a = ast.parse("from infer8.b import x\n")
    b = ast.parse("def f():\n    import infer8.a\n")
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name, tree in (("infer8.a", a), ("infer8.b", b)):
        for target in _imports(tree, {"infer8.a", "infer8.b"}):
            graph[_unit(name)][_unit(target)].append(target)
    assert _cycles(graph) == [["infer8.a", "infer8.b"]]
    guarded = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import infer8.a\n"
    )
    assert _imports(guarded, {"infer8.a"}) == set()


def test_models_never_import_a_concrete_attention_backend() -> None:
    """The model calls the backend it was handed: only the protocol and common metadata."""
    allowed = {"infer8.attention.backend", "infer8.attention.metadata", "infer8.attention.kv_cache"}
    sources = {_module_name(p): p for p in ROOT.rglob("*.py")}
    for name, path in sources.items():
        if not name.startswith("infer8.models"):
            continue
        targets = _imports(ast.parse(path.read_text()), set(sources))
        attention = {t for t in targets if t.startswith("infer8.attention")}
        assert attention <= allowed, f"{name} imports {sorted(attention - allowed)}"

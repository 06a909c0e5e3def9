"""No import cycles between treejax's modules at module level (AST only: nothing is imported).

The graph: one node per module of the package (``treejax/x/__init__.py`` is ``treejax.x``), one edge per import
statement, absolute or relative: ``import treejax.a.b`` and ``from treejax.a import b`` where ``b`` is a submodule
both import ``treejax.a.b``; ``from treejax.a import name`` imports ``treejax.a``. (The parent packages Python
initialises on the way are not edges: every module would otherwise sit on a cycle with its package's
``__init__``.) An import is *module level* unless it sits inside a function (a ``def`` or ``lambda`` at any depth);
imports under ``if TYPE_CHECKING:`` never run and are left out.

``test_no_module_level_cycles`` is the contract: 0 cycles through module-level imports. Cycles that close only
through function-level (deferred) imports are legal Python and are listed by ``python tests/test_import_cycles.py``;
``test_function_level_cycles_are_known`` keeps them from growing unnoticed.
"""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "treejax"

#: Cycles that close only through function-level imports, each as the sorted modules of its strongly connected
#: component. They run at call time, after every module involved has finished importing, so they are legal; the
#: list is here so that a new one is a decision, not an accident (see the module docstring).
KNOWN_FUNCTION_LEVEL_CYCLES: list[tuple[str, ...]] = []


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    path: str  # relative to the repository root
    line: int
    module_level: bool

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _modules(root: str = ROOT) -> dict[str, str]:
    """``{module name: file path}`` of every module of the package."""
    out = {}
    base = os.path.join(root, PACKAGE)
    for folder, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, f), root)
            parts = rel[:-3].split(os.sep)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = os.path.join(folder, f)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Every import statement of a module with whether it runs at module level."""

    def __init__(self):
        self.depth = 0  # function nesting
        self.found: list[tuple[ast.stmt, bool]] = []

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If):
        if _is_type_checking(node.test):  # never runs; its else branch does
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        self.found.append((node, self.depth == 0))

    visit_ImportFrom = visit_Import


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative levels resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_edges(root: str = ROOT) -> list[Edge]:
    """Every import of one treejax module by another (self-imports left out), in file and line order."""
    modules = _modules(root)
    edges = []
    for name, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
        visitor = _Imports()
        visitor.visit(tree)
        rel = os.path.relpath(path, root)
        is_package = os.path.basename(path) == "__init__.py"
        for node, module_level in visitor.found:
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = _resolve(name, is_package, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for target in dict.fromkeys(targets):
                if target in modules and target != name:
                    edges.append(Edge(name, target, rel, node.lineno, module_level))
    return edges


def _components(nodes, adjacency: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(adjacency.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(adjacency.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return sorted(out)


def _shortest_cycle(component: list[str], edges: list[Edge]) -> list[Edge]:
    """One shortest cycle inside a component, as its edges (breadth-first from each member)."""
    inside = set(component)
    by_source: dict[str, list[Edge]] = {}
    for e in edges:
        if e.source in inside and e.target in inside:
            by_source.setdefault(e.source, []).append(e)
    best: list[Edge] | None = None
    for start in component:
        parent: dict[str, Edge] = {}
        frontier, seen, found = [start], {start}, None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for e in by_source.get(v, ()):
                    if e.target == start:
                        found = e
                        break
                    if e.target not in seen:
                        seen.add(e.target)
                        parent[e.target] = e
                        nxt.append(e.target)
                if found:
                    break
            frontier = nxt
        if found is None:
            continue
        path, v = [found], found.source
        while v != start:
            path.append(parent[v])
            v = parent[v].source
        path.reverse()
        if best is None or len(path) < len(best):
            best = path
    return best or []


def cycles(edges: list[Edge]) -> list[tuple[list[str], list[Edge]]]:
    """``(component, one shortest cycle in it)`` for every import cycle of ``edges``."""
    adjacency: dict[str, list[str]] = {}
    for e in edges:
        adjacency.setdefault(e.source, []).append(e.target)
    nodes = {e.source for e in edges} | {e.target for e in edges}
    return [(c, _shortest_cycle(c, edges)) for c in _components(nodes, adjacency)]


def describe(found: list[tuple[list[str], list[Edge]]]) -> str:
    lines = []
    for comp, cycle in found:
        lines.append(f"{len(comp)} modules: {', '.join(comp)}")
        lines.append("  e.g. " + " -> ".join([cycle[0].source] + [f"{e.target} ({e.where()}"
                                                                    f"{'' if e.module_level else ', in a function'})"
                                                                    for e in cycle]))
    return "\n".join(lines)


def function_level_cycles(edges: list[Edge]) -> list[tuple[list[str], list[Edge]]]:
    """Cycles of the whole graph that are no module-level cycle (they need at least one function-level import)."""
    module_level = {tuple(c) for c, _ in cycles([e for e in edges if e.module_level])}
    return [(c, cyc) for c, cyc in cycles(edges) if tuple(c) not in module_level]


# ----------------------------------------------------------------------------------------------- the tests
def test_graph_sees_every_import_form(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from treejax import top\n"
                                         "def f():\n    from ..top import g\n")
    (pkg / "top.py").write_text("import treejax.sub.leaf\nfrom treejax.sub import leaf, name\n")
    edges = {(e.source, e.target, e.module_level) for e in import_edges(str(tmp_path))}
    assert edges == {("treejax.sub", "treejax.sub.leaf", True), ("treejax.sub.leaf", "treejax.top", False),
                     ("treejax.top", "treejax.sub.leaf", True), ("treejax.top", "treejax.sub", True)}
    found = cycles(import_edges(str(tmp_path)))
    assert [c for c, _ in found] == [["treejax.sub", "treejax.sub.leaf", "treejax.top"]]
    assert [(e.source, e.target) for e in found[0][1]] in (
        [("treejax.sub.leaf", "treejax.top"), ("treejax.top", "treejax.sub.leaf")],
        [("treejax.top", "treejax.sub.leaf"), ("treejax.sub.leaf", "treejax.top")])  # a shortest cycle
    assert "treejax/sub/leaf.py:5, in a function" in describe(found)
    assert not cycles([e for e in import_edges(str(tmp_path)) if e.module_level])
    assert [c for c, _ in function_level_cycles(import_edges(str(tmp_path)))] == [c for c, _ in found]


def test_a_module_level_cycle_is_reported(tmp_path):
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from treejax import b\n")
    (pkg / "b.py").write_text("try:\n    import treejax.a as a\nexcept ImportError:\n    a = None\n")
    found = cycles([e for e in import_edges(str(tmp_path)) if e.module_level])
    assert describe(found) == ("2 modules: treejax.a, treejax.b\n"
                               "  e.g. treejax.a -> treejax.b (treejax/a.py:1) -> treejax.a (treejax/b.py:2)")


def test_no_module_level_cycles():
    found = cycles([e for e in import_edges() if e.module_level])
    assert not found, f"import cycles at module level:\n{describe(found)}"


def test_function_level_cycles_are_known():
    found = sorted(tuple(c) for c, _ in function_level_cycles(import_edges()))
    new = [c for c in found if c not in KNOWN_FUNCTION_LEVEL_CYCLES]
    assert not new, ("new import cycles through function-level imports (break them, or add them to "
                     f"KNOWN_FUNCTION_LEVEL_CYCLES with the reason):\n"
                     f"{describe([x for x in function_level_cycles(import_edges()) if tuple(x[0]) in new])}")


if __name__ == "__main__":
    all_edges = import_edges()
    print("module level:\n" + (describe(cycles([e for e in all_edges if e.module_level])) or "  none"))
    print("through function-level imports only:\n" + (describe(function_level_cycles(all_edges)) or "  none"))
    sys.exit(0)

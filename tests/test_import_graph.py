"""No import circle in the package: the graph of every import statement of triattn_cupy's
modules (at module level and inside functions, read with ast, nothing imported) has no
cycle. A circle hidden by a late import is still a circle: each side needs the other."""
from __future__ import annotations

import ast
import pathlib

import triattn_cupy

PACKAGE = pathlib.Path(triattn_cupy.__file__).parent


def _modules() -> dict:
    """{dotted name: (path, is a package)} of every module of triattn_cupy."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if package else parts)] = (path, package)
    return modules


def import_graph() -> dict:
    """{module: the package's modules its import statements name}: `from X import y` names
    X.y where that is a module, else X."""
    modules, graph = _modules(), {}
    for name, (path, package) in modules.items():
        here = name.split(".") if package else name.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                edges.update(f"{target}.{alias.name}" if f"{target}.{alias.name}" in modules
                             else target for alias in node.names)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def cycles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "triattn_cupy.gpu.routes" in graph["triattn_cupy.gpu.launch_plan"]  # (read)
    assert cycles(graph) == []


def test_a_circle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]

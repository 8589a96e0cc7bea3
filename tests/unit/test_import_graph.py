"""No import circle among the project's modules, lazy (function-level) imports included.

Read with `ast` from the source, so nothing is imported and a circle that only closes at run
time (an import inside a function) is found too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import REPO

PACKAGES = ("supervisor", "faults", "worker")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in its body (`from a import b` counts as
    `a.b` when that is a module, else `a`)."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]  # fmt: skip
        else:
            continue
        found |= {n for n in names if n in modules and n != here}
    return found


def graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {module_name(p) for p in files}
    return {module_name(p): imports(p, modules) for p in files}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
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
                out.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    g = graph()
    assert "faults.spec" in g["supervisor.config"]  # lazy imports are seen
    assert cycles(g) == []


def test_the_config_errors_module_is_a_leaf() -> None:
    assert graph()["supervisor.config_table"] == set()

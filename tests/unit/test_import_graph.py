"""The layer rules, read with `ast` from the source (nothing is imported, and an import inside a
function counts as much as one at the top).

- `contracts/` (what the processes and files agree on) imports only the standard library.
- Top-level packages import one way: `supervisor` -> `faults` -> `contracts`, `worker` ->
  `contracts`. The supervisor reaches the worker only by name (its torch-free spec, loaded in
  `supervisor/settings/worker_spec.py`) and the fault engine only through `faults/__init__.py`.
  `testbed` (real hosts on one machine, for the tests) imports none of the others.
- Inside `supervisor/`, every module lives in a role subpackage of a layer; a module imports only
  its own subpackage and lower layers.
- No file circle: `from pkg import module` reads `pkg/__init__.py` (the package's namespace), so it
  counts as an import of that file too, and an `__init__` that imports the module back is a
  circle. A module imports its siblings by their own path (`from pkg.module import name`).
- `worker/ckpt/` imports none of the training loop's modules: what it reports to comes in as
  its own protocols (`worker/ckpt/ports.py`).
- No module over 450 lines, no class over 300; launcher kinds and flavors are compared only in
  the launch code.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.support import REPO

PACKAGES = ("contracts", "supervisor", "faults", "worker", "testbed")
# Which top-level package may import which (besides itself).
ALLOWED = {
    "contracts": set(),
    "worker": {"contracts"},
    "faults": {"contracts"},
    "supervisor": {"contracts", "faults"},
    "testbed": set(),
}
# supervisor/'s role subpackages, lowest first: a module imports only its own and lower layers.
LAYERS = {
    "log": 0,
    "settings": 1,
    "reporting": 1,
    "policy": 2,
    "launch": 3,
    "watch": 3,
    "host": 4,
    "run": 5,
    "commands": 6,
}
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 300
LAUNCHER_NAMES = {"mpiexec", "srun", "local"}
FLAVOR_NAMES = {"hydra", "pals"}  # launch.flavor: of mpiexec
# What worker/ckpt/ may import of the worker besides itself: the rank's identity, the JSON
# collectives, the usage error, the rank's lease and the threads' priority, none of which
# imports the loop (the closure is checked).
CKPT_MAY_IMPORT = {
    "worker", "worker.collectives", "worker.dist", "worker.errors", "worker.lease",
    "worker.priority",
}  # fmt: skip


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_statements(path: Path, root: Path = REPO) -> list[tuple[str | None, list[str]]]:
    """Every import anywhere in `path`: (the package or module a `from` names, None for a plain
    `import`; the names it imports, absolute: `from a import b` gives `a.b`)."""
    here = module_name(path, root)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    found: list[tuple[str | None, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.append((None, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found.append((base, [f"{base}.{a.name}" for a in node.names]))
    return found


def raw_imports(path: Path) -> list[str]:
    """Every name imported anywhere in `path`, absolute (`from a import b` gives `a.b`)."""
    return [name for _, names in import_statements(path) for name in names]


def project_files() -> list[Path]:
    return [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]


def graph(files: list[Path] | None = None, root: Path = REPO) -> dict[str, set[str]]:
    """Module -> the project modules it imports (`from a import b`: `a.b` when a module, else
    `a`; and `a` itself either way: the statement reads `a`'s namespace, its `__init__`)."""
    files = project_files() if files is None else files
    modules = {module_name(p, root) for p in files}
    out = {}
    for p in files:
        here = module_name(p, root)
        names: set[str] = set()
        for base, imported in import_statements(p, root):
            names |= {n if n in modules else n.rpartition(".")[0] for n in imported}
            if base is not None:
                names.add(base)
        out[here] = {n for n in names if n in modules and n != here}
    return out


def top(module: str) -> str:
    return module.split(".")[0]


def test_contracts_import_only_the_standard_library():
    bad = {
        f"{module_name(p)} -> {name}"
        for p in (REPO / "contracts").rglob("*.py")
        for name in raw_imports(p)
        if top(name) not in sys.stdlib_module_names and top(name) not in {"contracts", "__future__"}
    }
    assert not bad, sorted(bad)


def package_edges(g: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(top(m), top(d)) for m, deps in g.items() for d in deps if top(m) != top(d)}


def test_packages_import_one_way():
    edges = package_edges(graph())
    assert not {(a, b) for a, b in edges if (b, a) in edges}, "two packages import each other"
    bad = {(a, b) for a, b in edges if b not in ALLOWED[a]}
    assert not bad, sorted(bad)


def test_the_supervisor_reaches_faults_only_through_its_interface():
    bad = {
        f"{m} -> {d}"
        for m, deps in graph().items()
        if top(m) == "supervisor"
        for d in deps
        if top(d) == "faults" and d != "faults"
    }
    assert not bad, sorted(bad)


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def test_supervisor_modules_live_in_role_subpackages():
    loose = {
        p.name
        for p in (REPO / "supervisor").glob("*.py")
        if p.name not in {"__init__.py", "__main__.py"}
    }
    assert not loose, f"modules outside a role subpackage: {sorted(loose)}"
    subs = {p.name for p in (REPO / "supervisor").iterdir() if (p / "__init__.py").is_file()}
    assert subs == set(LAYERS), "a subpackage without a layer (or a layer without a package)"
    for sub in subs:
        doc = ast.get_docstring(ast.parse((REPO / "supervisor" / sub / "__init__.py").read_text()))
        assert doc and "import" in doc, (
            f"supervisor/{sub}/__init__.py: say what lives there and what it may import"
        )


def test_a_lower_layer_never_imports_a_higher_one():
    bad = set()
    for m, deps in graph().items():
        if top(m) != "supervisor" or (sub := layer_of(m)) is None:
            continue
        for d in deps:
            if top(d) != "supervisor" or (dsub := layer_of(d)) is None or dsub == sub:
                continue
            if LAYERS[dsub] >= LAYERS[sub]:
                bad.add(f"{m} ({sub}, layer {LAYERS[sub]}) -> {d} ({dsub}, layer {LAYERS[dsub]})")
    assert not bad, sorted(bad)


def test_the_rules_catch_what_they_forbid():
    assert package_edges({"worker.a": {"supervisor.b"}, "supervisor.b": {"worker.a"}}) == {
        ("worker", "supervisor"),
        ("supervisor", "worker"),
    }
    assert layer_of("supervisor.run.job") == "run" and layer_of("supervisor.__main__") is None


def test_no_module_or_class_is_too_long():
    files = [p for p in REPO.rglob("*.py") if ".venv" not in p.parts]
    long_modules = {
        f"{p.relative_to(REPO)}: {n}"
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    long_classes = {
        f"{p.relative_to(REPO)}:{node.name}: {node.end_lineno - node.lineno + 1}"
        for p in files
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
    }
    assert not long_modules and not long_classes, sorted(long_modules | long_classes)


def compared_names(source: str, names: set[str]) -> list[int]:
    """The lines where one of `names` is compared (`==`, `!=`, `in` a literal tuple, list or
    set)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            sides += [e for c in sides if isinstance(c, ast.Tuple | ast.List | ast.Set)
                      for e in c.elts]  # fmt: skip
            if names & {c.value for c in sides if isinstance(c, ast.Constant)}:
                lines.append(node.lineno)
    return lines


def test_launcher_kinds_and_flavors_are_compared_only_in_the_launch_code():
    bad = {
        f"{p.relative_to(REPO)}:{line}"
        for p in (REPO / "supervisor").rglob("*.py")
        if "launch" not in p.relative_to(REPO).parts
        for line in compared_names(p.read_text(), LAUNCHER_NAMES | FLAVOR_NAMES)
    }
    assert not bad, sorted(bad)


def test_the_name_rule_sees_every_way_of_comparing():
    for source in ('f != "pals"', '"hydra" == f', 'f in ("pals", "x")', 'k not in {"srun"}'):
        assert compared_names(source, LAUNCHER_NAMES | FLAVOR_NAMES) == [1], source
    assert compared_names('FACTS = {"pals": False}', FLAVOR_NAMES) == []  # a table, no compare


def closure(g: dict[str, set[str]], start: set[str]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += g.get(m, ())
    return seen


def test_the_checkpoint_package_imports_none_of_the_training_loop():
    """worker/ckpt/ sits below the loop (worker.beat, worker.guard, worker.metrics, the loop
    and its build): it takes what it reports to as protocols of its own (worker/ckpt/ports.py)
    and is handed them."""
    g = graph()
    ckpt = {m for m in g if m == "worker.ckpt" or m.startswith("worker.ckpt.")}
    reached = closure(g, {d for m in ckpt for d in g[m]}) - ckpt
    bad = {m for m in reached if top(m) == "worker" and m not in CKPT_MAY_IMPORT}
    assert not bad, sorted(bad)


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


def test_no_import_circle():
    assert cycles(graph()) == []


def test_a_circle_through_a_packages_init_is_found(tmp_path):
    """`faults/engine.py` said `from faults import actions`, which runs `faults/__init__.py`,
    which imports the engine: a circle of files the module graph alone did not show."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.engine import Engine\n")
    (pkg / "actions.py").write_text("def act(): ...\n")
    (pkg / "engine.py").write_text("from pkg import actions\n")
    files = sorted(pkg.glob("*.py"))
    assert cycles(graph(files, tmp_path)) == [["pkg", "pkg.engine"]]
    (pkg / "engine.py").write_text("from pkg.actions import act\n")  # by its own path
    assert cycles(graph(files, tmp_path)) == []

"""The worker's torch-free spec, loaded by name: the one place the supervisor reaches a worker.

A `worker.module`'s spec is the module `spec` of the same package (`worker.train` ->
`worker.spec`), used when its `MODULES` names that module. The spec checks the module's flags
and plans them for a smaller world; its contract (the names it defines, refusals as strings) is
in `worker/spec.py`'s docstring. A module without one (a top-level module, a package with no
`spec`, or a spec that does not name it) has its flags passed as given, checked for their shape
only, and a shrink changes none of them. Finding a spec runs no code: the module `spec` is
looked for as the import system would, without importing its packages, and only one that
exists is imported (with its packages' `__init__`, never the worker module itself). So a
`worker.module` in a package with no `spec` (`torch.distributed.run`) costs `validate` nothing.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from collections.abc import Sequence
from typing import Any, Protocol, cast


class ShrinkPlan(Protocol):
    """What the supervisor reads of a spec's shrink plan."""

    new_world: int
    flags: dict[str, Any]  # the [worker] keys the smaller world overrides
    problem: str | None  # why the smaller world cannot run; None: it can

    def event(self) -> dict[str, Any]: ...


class WorkerSpec(Protocol):
    """A worker package's `spec` module, as the supervisor calls it."""

    MODULES: tuple[str, ...]

    def flag_kinds(self) -> dict[str, bool]: ...

    def flags_problem(self, argv: Sequence[str]) -> str | None: ...

    def run_problem(self, argv: Sequence[str], world: int) -> str | None: ...

    def plan_shrink(self, argv: Sequence[str], world: int, new_world: int) -> ShrinkPlan: ...


CALLS = ("flag_kinds", "flags_problem", "run_problem", "plan_shrink")  # WorkerSpec's functions


def flag_defaults(spec: WorkerSpec | None) -> dict[str, Any]:
    """The spec's flag defaults by `[worker]` key (its optional `flag_defaults()`); {} for a
    worker without a spec or a spec without them."""
    defaults = getattr(spec, "flag_defaults", None)
    return dict(defaults()) if callable(defaults) else {}


def declares_standby(spec: WorkerSpec | None, module: str) -> bool:
    """Whether the spec names `module` in its optional `STANDBY_MODULES`: that the module,
    started with `ES_STANDBY=1`, prepares and waits for `go` instead of training at once. A
    worker without a spec declares nothing."""
    return module in getattr(spec, "STANDBY_MODULES", ())


class SpecError(ValueError):
    """A worker package's `spec` that cannot be imported, or names the module but lacks one of
    the contract's functions (one line)."""


def load(module: str) -> WorkerSpec | None:
    """The spec of the worker module `module` (`python -m` name), or None where it has none;
    SpecError where its package's `spec` fails to import or is incomplete."""
    package = module.rpartition(".")[0]
    if not package:
        return None
    name = f"{package}.spec"
    if not _exists(name):
        return None
    try:
        spec = importlib.import_module(name)
    except Exception as exc:  # the package's own code: any error is the package's to fix
        raise SpecError(
            f"{name} (the spec of {module}) fails to import: {type(exc).__name__}: {exc}"
        ) from None
    if module not in getattr(spec, "MODULES", ()):
        return None
    lacking = [call for call in CALLS if not callable(getattr(spec, call, None))]
    if lacking:
        raise SpecError(f"{name} names {module} in MODULES but lacks {', '.join(lacking)}")
    return cast(WorkerSpec, spec)


def _exists(name: str) -> bool:
    """Whether the module `name` can be found, asking the import system's finders part by part
    (`importlib.util.find_spec` would import, and so run, every package above it)."""
    parts = name.split(".")
    search: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        loaded = sys.modules.get(prefix)
        if loaded is not None:
            locations = getattr(loaded, "__path__", None)
        else:
            found = _find(prefix, search)
            if found is None:
                return False
            locations = found.submodule_search_locations
        if depth < len(parts):
            if locations is None:  # a module, not a package: it has no submodules
                return False
            search = list(locations)
    return True


def _find(name: str, search: list[str] | None) -> importlib.machinery.ModuleSpec | None:
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        found = find(name, search) if find is not None else None
        if found is not None:
            return found
    return None

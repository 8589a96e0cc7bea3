"""The worker's torch-free spec, loaded by name: the one place the supervisor reaches a worker.

A `worker.module`'s spec is the module `spec` of the same package (`worker.train` ->
`worker.spec`), used when its `MODULES` names that module. The spec checks the module's flags
and plans them for a smaller world; its contract (the names it defines, refusals as strings) is
in `worker/spec.py`'s docstring. A module without one (a top-level module, a package with no
`spec`, or a spec that does not name it) has its flags passed as given, checked for their shape
only, and a shrink changes none of them. Finding a spec imports the module's package (its
`__init__`), never the module itself.
"""

from __future__ import annotations

import importlib
import importlib.util
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


def load(module: str) -> WorkerSpec | None:
    """The spec of the worker module `module` (`python -m` name), or None where it has none."""
    package = module.rpartition(".")[0]
    if not package:
        return None
    name = f"{package}.spec"
    try:
        found = importlib.util.find_spec(name)
    except ImportError:  # no such package (or a module, not a package)
        return None
    if found is None:
        return None
    spec = importlib.import_module(name)
    return cast(WorkerSpec, spec) if module in getattr(spec, "MODULES", ()) else None

"""The launcher kinds by the name a config gives them (`launch.launcher`)."""

from __future__ import annotations

from supervisor.launch.kinds import FLAVOR_NAMES, LauncherKind, Local, Mpiexec, Srun
from supervisor.settings.launcher_kinds import FLAVOR_EMULATES, KIND_FACTS

KINDS: dict[str, type[LauncherKind]] = {kind.name: kind for kind in (Mpiexec, Srun, Local)}
if set(KINDS) != set(KIND_FACTS):  # the config's checks and the launch code name the same kinds
    raise ImportError(
        f"launcher kinds {sorted(KINDS)} differ from the config's {sorted(KIND_FACTS)}"
    )
if {*FLAVOR_NAMES, "auto"} != set(FLAVOR_EMULATES):  # and the same flavors
    raise ImportError(f"flavors {sorted(FLAVOR_NAMES)} differ from the config's {FLAVOR_EMULATES}")


def launcher_for(name: str) -> LauncherKind:
    """The kind named `name`; ValueError naming the known ones for any other name."""
    try:
        return KINDS[name]()
    except KeyError:
        known = ", ".join(KINDS)
        raise ValueError(f"unknown launcher kind {name!r}; known: {known}") from None

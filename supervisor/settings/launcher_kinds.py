"""The launcher kinds a config may name (`launch.launcher`) and what checking a config needs to
know of each. The launch code has a class per kind behind its registry, which reads these facts
from here and refuses to load if its names and these differ."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KindFacts:
    this_host_only: bool  # starts every rank on this host itself: no host file, no other node
    emulates_nodes: bool  # can run named nodes all on this host (MPICH Hydra's fork launcher)


KIND_FACTS: dict[str, KindFacts] = {
    "mpiexec": KindFacts(this_host_only=False, emulates_nodes=True),
    "srun": KindFacts(this_host_only=False, emulates_nodes=False),
    "local": KindFacts(this_host_only=True, emulates_nodes=False),
}
# `launch.flavor` (of a kind with flavors: mpiexec), and whether it may run emulated nodes: only
# MPICH Hydra's fork launcher can ("auto" is judged again once the flavor is found).
FLAVOR_EMULATES: dict[str, bool] = {"auto": True, "hydra": True, "pals": False}

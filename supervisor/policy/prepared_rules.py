"""Pure decisions for prepared ranks ([restart] warm_spare): whether a job keeps them, and which
of them become the ranks of a relaunch on a given node list."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

PREPARED_WORKER = "worker.train"  # the worker whose prepared form worker.prepared is


def unavailable(
    *,
    wanted: bool,
    standby_off: str | None,
    spares: int,
    launcher_cannot: str | None,
    module: str,
) -> str | None:
    """Why this job keeps no prepared ranks, or None when it does. They serve the relaunch a
    standby cannot (a node lost, a spare in its place), so they need a spare and the standby
    (`standby_off`: why the job keeps none); each node's are a launch of their own
    (`launcher_cannot`: why the launcher cannot)."""
    if not wanted:
        return "restart.warm_spare is false"
    if standby_off is not None:
        return standby_off
    if spares < 1:
        return "no spare node (launch.spares = 0)"
    if launcher_cannot is not None:
        return launcher_cannot
    if module != PREPARED_WORKER:
        return f"worker module {module} has no prepared form (only {PREPARED_WORKER})"
    return None


def template_unavailable(*, wanted: bool, launcher_cannot: str | None, module: str) -> str | None:
    """Why this job keeps no fork templates ([restart] template), or None when it does: each
    node's is a launch of its own, and it imports the project's worker (no other)."""
    if not wanted:
        return "restart.template is false"
    if launcher_cannot is not None:
        return launcher_cannot.replace("prepared ranks", "fork templates")
    if module != PREPARED_WORKER:
        return f"worker module {module} has no fork template (only {PREPARED_WORKER})"
    return None


def placement(
    nodes: Sequence[str], ready: Mapping[str, Sequence[int]], ranks_per_node: int
) -> list[int] | str:
    """For each rank of an attempt on `nodes` (rank r on nodes[r // ranks_per_node], as the
    launch places them), the prepared rank that becomes it; or why they cannot all be served.
    `ready`: per node, its prepared ranks that wait, in their node's order."""
    chosen: list[int] = []
    for node in nodes:
        waiting = list(ready.get(node, ()))
        if len(waiting) < ranks_per_node:
            return f"no prepared ranks ready on {node} ({len(waiting)} of {ranks_per_node})"
        chosen += waiting[:ranks_per_node]
    return chosen

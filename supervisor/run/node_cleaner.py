"""The job's scratch removed on every node of a real multi-node job (`host.node_clean`, run on
each by the job's own launcher): at its end what its ranks left (memory slots, partner copies,
the async stage dir), at its start what jobs killed with their supervisor left. On this host
alone (one node, emulated nodes) `node_scratch` does it itself."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from typing import Any

from supervisor.host import node_check, node_clean
from supervisor.launch import hosts
from supervisor.launch.resolve import Resolved

CLEAN_TIMEOUT_S = 30.0  # every node together; a host that is gone answers nothing
NAMED = 50  # paths an event names (it counts them all)


def reports(lines: Iterable[str]) -> dict[str, dict[str, Any]]:
    """Pure: node -> its report, from the launcher's output lines."""
    found: dict[str, dict[str, Any]] = {}
    decoder = json.JSONDecoder()
    for line in lines:
        for body in line.split(node_clean.MARK)[1:]:
            try:
                report, _ = decoder.raw_decode(body)
            except ValueError:
                continue
            if isinstance(report, dict) and isinstance(report.get("node"), str):
                found[report["node"]] = report
    return found


def needed(resolved: Resolved) -> bool:
    """Whether the job has nodes other than this host (emulated ones are this host's)."""
    launch = resolved.cfg.launch
    if resolved.kind.this_host_only or launch.emulate_nodes:
        return False
    every = [*resolved.pool.active, *resolved.pool.spares, *resolved.pool.excluded]
    return not all(map(hosts.is_this_host, every))


async def clean_nodes(
    resolved: Resolved, job_id: str, when: str, emit: Callable[..., None]
) -> None:
    """Run the clean on every node the job has had (active, spare, excluded: a lost node may
    be back); a `node_clean` event says what each removed, and which did not answer."""
    if not needed(resolved):
        return
    pool = resolved.pool
    every = list(dict.fromkeys([*pool.active, *pool.spares, *pool.excluded]))
    flags: dict[str, Any] = {"job": job_id} if when == "end" else {}
    try:
        lines = await node_check.run_program(
            resolved, every, node_clean.__name__, flags, CLEAN_TIMEOUT_S, f"clean-{when}"
        )
    except OSError as exc:  # the launcher could not be started: the first attempt says more
        emit("node_clean", when=when, nodes=every, silent=every, count=0, paths=[], left=[],
             error=f"{exc.strerror or exc}")  # fmt: skip
        return
    found = reports(lines)
    silent = [n for n in every if n not in found]
    if silent and len(every) > 1:  # one host that does not answer fails a launch for all
        with contextlib.suppress(OSError):
            found.update(reports(await node_check.run_each(
                resolved, silent, node_clean.__name__, flags, CLEAN_TIMEOUT_S, f"clean-{when}"
            )))  # fmt: skip
    removed = [p for r in found.values() for p in r.get("removed", [])]
    left = [p for r in found.values() for p in r.get("left", [])]
    emit(
        "node_clean",
        when=when,
        nodes=every,
        silent=[n for n in every if n not in found],
        count=len(removed),
        paths=removed[:NAMED],
        left=left,
    )

"""Everything checked once the job is resolved and before anything launches.

What fails here would fail every attempt the same way (a flag the worker refuses, a host that
does not resolve), so it ends `validate`, `run` and `run --dry-run` with exit 2 and one line
instead of spending the restart budget on relaunches that cannot work.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from supervisor import launcher, memdir, protocol, worker_flags
from supervisor.config import ConfigError

if TYPE_CHECKING:
    from supervisor.resolve import Resolved

RESOLVE_WORKERS = 32


def check(r: Resolved) -> list[str]:
    """Raise ConfigError for the first problem; return notes on what could not be checked."""
    notes = []
    check_hosts(r)
    check_memory_root(r)
    note = worker_flags.check(r.cfg, r.world)
    if note:
        notes.append(note)
    return notes


def check_hosts(r: Resolved) -> None:
    """Every node other than this host must resolve: Hydra's ssh and PALS reach nodes by name,
    and a name that does not resolve fails every attempt ("Could not resolve hostname")."""
    if r.cfg.launch.launcher != "mpiexec" or r.cfg.launch.emulate_nodes:
        return  # local and emulated: this host; srun: Slurm places the ranks on nodes it knows
    others = [n for n in r.nodes if not launcher.is_this_host(n)]
    with ThreadPoolExecutor(max_workers=min(RESOLVE_WORKERS, len(others) or 1)) as pool:
        for node, error in zip(others, pool.map(_resolve_error, others), strict=True):
            if error:
                raise ConfigError(
                    r.cfg.source,
                    "launch.nodes",
                    f"host {node!r} does not resolve ({error}); fix the name or leave the node out",
                )


def check_memory_root(r: Resolved) -> None:
    """With a memory tier, its root on this node must take the job's directory (the supervisor
    holds it for the job's life)."""
    if not memdir.wanted(r.cfg.worker.flags):
        return
    root = memdir.root(r.cfg.launch.env)
    problem = memdir.root_problem(root)
    if problem:
        raise ConfigError(
            r.cfg.source,
            "worker.mem_ckpt_interval",
            f"the memory tier's root {root}: {problem}; set {protocol.ENV_MEM_ROOT} to a "
            "writable node-local directory",
        )


def _resolve_error(host: str) -> str | None:
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        return str(exc.args[-1]) if exc.args else type(exc).__name__
    return None

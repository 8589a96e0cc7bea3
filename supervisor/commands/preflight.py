"""Everything checked once the job is resolved and before anything launches.

What fails here would fail every attempt the same way (a flag the worker refuses, a host that
does not resolve), so it ends `validate`, `run` and `run --dry-run` with exit 2 and one line
instead of spending the restart budget on relaunches that cannot work.
"""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from contracts import env_names, inject
from supervisor.host import memdir, ownership
from supervisor.launch import hosts
from supervisor.settings import worker_flags
from supervisor.settings.config import ConfigError

if TYPE_CHECKING:
    from supervisor.launch.resolve import Resolved

RESOLVE_WORKERS = 32


def check(resolved: Resolved) -> list[str]:
    """Raise ConfigError for the first problem; return notes on what could not be checked."""
    notes = list(resolved.notes)
    check_hosts(resolved)
    check_dirs(resolved)
    check_group(resolved)
    check_bind(resolved)
    check_memory_root(resolved)
    check_inject(resolved)
    note = worker_flags.check(resolved.cfg, resolved.world)
    if note:
        notes.append(note)
    note = standby_note(resolved)
    if note:
        notes.append(note)
    return notes


def standby_note(resolved: Resolved) -> str | None:
    """One line when the config asks for the warm standby and the worker does not declare it: a
    worker that ignores `ES_STANDBY` would train beside the job, so the job keeps none."""
    why = resolved.standby_off
    if not resolved.cfg.restart.standby or why is None:
        return None
    return f"restart.standby is off: {why}, so every relaunch starts cold"


def check_hosts(resolved: Resolved) -> None:
    """Every node other than this host must resolve: Hydra's ssh and PALS reach nodes by name,
    and a name that does not resolve fails every attempt ("Could not resolve hostname")."""
    if not resolved.kind.reaches_nodes_by_name or resolved.cfg.launch.emulate_nodes:
        return  # local and emulated: this host; srun: Slurm places the ranks on nodes it knows
    others = [n for n in resolved.nodes if not hosts.is_this_host(n)]
    with ThreadPoolExecutor(max_workers=min(RESOLVE_WORKERS, len(others) or 1)) as pool:
        for node, error in zip(others, pool.map(_resolve_error, others), strict=True):
            if error:
                raise ConfigError(
                    resolved.cfg.source,
                    "launch.nodes",
                    f"host {node!r} does not resolve ({error}); fix the name or leave the node out",
                )


def check_dirs(resolved: Resolved) -> None:
    """The run dir and checkpoint dir can be made, and, when every node is this host, so can the
    stage dir, and the working directory, the ranks' Python and the data exist: each would fail
    every attempt the same way (or `run` before the first)."""
    cfg, flags = resolved.cfg, resolved.cfg.worker.flags
    wanted = [("job.run_dir", resolved.run_dir)]
    if isinstance(flags.get("ckpt_dir"), str):
        wanted.append(("worker.ckpt_dir", Path(flags["ckpt_dir"])))
    here = resolved.kind.this_host_only or all(hosts.is_this_host(n) for n in resolved.nodes)
    if here and isinstance(flags.get("ckpt_stage_dir"), str):
        wanted.append(("worker.ckpt_stage_dir", Path(flags["ckpt_stage_dir"])))
    for key, path in wanted:
        problem = dir_problem(path)
        if problem:
            raise ConfigError(cfg.source, key, f"{path}: {problem}")
    if not here:
        return  # paths on other nodes are theirs to have
    launch = cfg.launch
    if launch.cwd and not Path(launch.cwd).is_dir():
        what = "not a directory" if Path(launch.cwd).exists() else "no such directory"
        raise ConfigError(cfg.source, "launch.cwd", f"{launch.cwd}: {what}")
    if launch.python and not (Path(launch.python).is_file() and os.access(launch.python, os.X_OK)):
        raise ConfigError(cfg.source, "launch.python", f"{launch.python}: no such executable file")
    data = flags.get("data_path")
    if isinstance(data, str) and not Path(launch.cwd or ".", data).is_file():
        raise ConfigError(cfg.source, "worker.data_path", f"{data}: no such file")


def check_group(resolved: Resolved) -> None:
    """[job] share_with_group names a group of this host that the user is in: the job's
    directories are given to it when they are made."""
    group = resolved.cfg.job.share_with_group
    problem = ownership.group_problem(group) if group else None
    if problem:
        raise ConfigError(resolved.cfg.source, "job.share_with_group", problem)


def dir_problem(path: Path) -> str | None:
    """Why a directory cannot be at `path` (None: one is there, or can be made): a file in the
    way, or the nearest existing directory not writable."""
    found = path
    try:
        while not found.exists():
            if found.parent == found:
                return None
            found = found.parent
    except OSError as exc:  # a name over NAME_MAX or PATH_MAX: exists() raises, not False
        return f"cannot be a path here ({exc.strerror}); shorten it"
    if not found.is_dir():
        return "is a file, not a directory" if found == path else f"{found} is not a directory"
    if not os.access(found, os.W_OK | os.X_OK):
        return f"{found} is not writable"
    return None


def check_bind(resolved: Resolved) -> None:
    """[heartbeat] bind and port can be bound on this host: a name that is no interface or
    address, or a port in use, would otherwise end `run` with ZeroMQ's traceback."""
    heartbeat = resolved.cfg.heartbeat
    if heartbeat.bind == "auto" and not heartbeat.port:
        return
    import zmq

    bind = heartbeat.bind if heartbeat.bind != "auto" else "127.0.0.1"
    sock = zmq.Context.instance().socket(zmq.PULL)
    try:
        if heartbeat.port:
            sock.bind(f"tcp://{bind}:{heartbeat.port}")
        else:
            sock.bind_to_random_port(f"tcp://{bind}")
    except zmq.ZMQError as exc:
        key = (
            "heartbeat.port" if heartbeat.port and exc.errno == zmq.EADDRINUSE else "heartbeat.bind"
        )
        raise ConfigError(
            resolved.cfg.source,
            key,
            f'cannot listen on {bind}:{heartbeat.port or "*"} ({exc.strerror}); expected "auto", '
            '"*", an address or interface of this host, and a free port (0: any)',
        ) from None
    finally:
        sock.close(0)


def check_memory_root(resolved: Resolved) -> None:
    """With a memory tier, its root on this node must take the job's directory (the supervisor
    holds it for the job's life)."""
    if not memdir.wanted(resolved.cfg.worker.flags):
        return
    root = memdir.root(resolved.cfg.launch.env)
    problem = memdir.root_problem(root)
    if problem:
        raise ConfigError(
            resolved.cfg.source,
            "worker.mem_ckpt_interval",
            f"the memory tier's root {root}: {problem}; set {env_names.ENV_MEM_ROOT} to a "
            "writable node-local directory",
        )


def check_inject(resolved: Resolved) -> None:
    """The test-only failure points the ranks and the node check would read (`ES_INJECT`, here
    or in [launch] env) are valid: a bad one would end every rank, or fail every node's check,
    the same way."""
    env = {**os.environ, **resolved.cfg.launch.env}
    try:
        inject.read(env)
    except inject.InjectError as exc:
        key = "launch.env" if env_names.ENV_INJECT in resolved.cfg.launch.env else ""
        raise ConfigError(resolved.cfg.source, key, str(exc)) from None


def _resolve_error(host: str) -> str | None:
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        return str(exc.args[-1]) if exc.args else type(exc).__name__
    return None

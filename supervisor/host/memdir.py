"""The memory checkpoint tier's directory on the supervisor's node, for the job's whole life.

The ranks keep their memory slots in `<root>/es-mem-<job id>/` (`scratch.mem_dir`), which
outlives them so that the next attempt can resume from it. The supervisor holds it shared from the
job's start (so no other job's sweep can take it between attempts) and removes it when the job
ends, however it ends. A supervisor killed outright cannot: its directory is left to the next job
on the node, whose start sweeps this user's directories of exactly that form
(`scratch.MEM_DIR_NAME`: `es-mem-<job name>-<8 hex digits>` or `es-mem-<12 hex digits>`) that
no live process holds: neither its lock (`locks.take_if_abandoned`) nor any file or working
directory under it (`/proc`: a job whose name made its path nest, a lock file removed by hand).

`wanted` and `sweepable` decide; `root_problem` looks; `sweep_abandoned`, `hold` and `remove`
act.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from contracts import env_names, intervals, locks, scratch
from supervisor.host import hygiene
from supervisor.settings.config import LaunchConfig


# --- decisions ------------------------------------------------------------------------------------
def wanted(worker_flags: Mapping[str, Any]) -> bool:
    """Whether the job's ranks keep a memory tier (`[worker] mem_ckpt_interval` > 0, or "auto"
    with a checkpoint dir, as resolved)."""
    interval = worker_flags.get("mem_ckpt_interval")
    if interval == intervals.AUTO:
        return bool(worker_flags.get("ckpt_dir"))
    return isinstance(interval, int) and not isinstance(interval, bool) and interval > 0


def sweepable(name: str, st: os.stat_result, uid: int) -> bool:
    """An entry of the root a sweep may look into: a directory of exactly a memory tier's form
    (`scratch.MEM_DIR_NAME`), itself (never a symlink: `st` is its lstat), owned by `uid`."""
    return (
        scratch.MEM_DIR_NAME.fullmatch(name) is not None
        and stat.S_ISDIR(st.st_mode)
        and st.st_uid == uid
    )


def held_under(path: str, held: set[str]) -> bool:
    """Pure: whether any of `held` (what live processes hold open, map, or work in: canonical
    paths) is `path` or lies under it."""
    prefix = path.rstrip("/") + "/"
    return path in held or any(p.startswith(prefix) for p in held)


def root(launch_env: dict[str, str]) -> str:
    """The base of the memory roots the ranks will use: they inherit our environment plus
    [launch] env."""
    return scratch.base_root({**os.environ, **launch_env})


def rank_env(launch: LaunchConfig) -> dict[str, str]:
    """What the ranks are told of their memory root beyond [launch] env: with emulated nodes
    (which share one host) each node keeps its own (`ES_MEM_PER_NODE`). The ranks' launch and
    the fault engine (which takes a lost node's root away) both read it here."""
    return {env_names.ENV_MEM_PER_NODE: "1"} if launch.emulate_nodes else {}


def roots(launch_env: dict[str, str], emulated_nodes: list[str] | None) -> list[str]:
    """Where the ranks on this host keep their memory tier: the one root, or with emulated nodes
    each node's own under it (`scratch.node_root`: the ranks get `ES_MEM_PER_NODE`)."""
    base = root(launch_env)
    if not emulated_nodes:
        return [base]
    return [scratch.node_root(base, n) for n in dict.fromkeys(emulated_nodes)]


def root_problem(path: str) -> str | None:
    """Why the job's memory directory could not be made under `path` (checked before launch),
    or None."""
    found = os.path.abspath(path)
    while not os.path.lexists(found):  # hold() creates what is missing below the nearest one
        found = os.path.dirname(found)
    if not os.path.isdir(found):
        return f"{found} is not a directory"
    if not os.access(found, os.W_OK | os.X_OK):
        return f"{found} is not writable"
    return None


# --- acts -----------------------------------------------------------------------------------------
def sweep_abandoned(root: str | os.PathLike, proc_root: str = "/proc") -> list[str]:
    """Remove this user's memory-tier directories under `root` (of exactly their form) that no
    live process holds; return the paths removed. Held: its lock (a job's supervisor and
    ranks), or anything under it another process has open, maps or works in (`proc_root`, read
    once, when a first lock could be taken). A missing (or unreadable) root is nothing to do;
    an entry that cannot be read, taken or removed is left as it is."""
    try:
        names = sorted(os.listdir(root))
    except OSError:  # missing, not a directory, not ours to read: nothing to sweep
        return []
    uid = os.getuid()
    removed = []
    held: set[str] | None = None
    for name in names:
        path = os.path.join(root, name)
        try:
            before = os.lstat(path)
        except OSError:
            continue
        if not sweepable(name, before, uid):
            continue
        fd = locks.take_if_abandoned(path)
        if fd is None:  # a live job (its supervisor or a rank) holds it
            continue
        try:
            if held is None:
                held = hygiene.held_paths(proc_root, cwd=True, skip_pid=os.getpid())
            if held_under(os.path.realpath(path), held):  # in use, whatever its lock says
                continue
            if _same_dir(path, before):  # not swapped for another entry since we looked
                shutil.rmtree(path, ignore_errors=True)
                if not os.path.lexists(path):
                    removed.append(path)
        finally:
            os.close(fd)
    return removed


@dataclass(frozen=True)
class Held:
    """The job's own memory directory and the descriptor that holds it shared."""

    path: str
    fd: int


def hold(root: str | os.PathLike, job_id: str) -> Held:
    """Create (0700) and hold the job's memory directory until `remove`. Raises OSError."""
    path = scratch.mem_dir(root, job_id)
    return Held(path, locks.hold_mem_dir(path))


def remove(held: Held) -> str | None:
    """Remove the job's memory directory, then let it go; None when it is gone, else why not."""
    error: str | None = None
    try:
        shutil.rmtree(held.path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        error = f"{exc.strerror or exc} ({exc.filename or held.path})"
    finally:
        os.close(held.fd)
    return error


def _same_dir(path: str, before: os.stat_result) -> bool:
    try:
        now = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(now.st_mode) and (now.st_dev, now.st_ino) == (before.st_dev, before.st_ino)

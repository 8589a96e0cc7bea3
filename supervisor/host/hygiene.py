"""Node hygiene (issue 17): what a job's attempts leave on the supervisor's node, and its removal.

Killed attempts used to leave, per attempt, MPICH's shared-memory segment in /dev/shm
(`mpich_shm_<world>_<node>`, 2 MB, unlinked only by MPI_Finalize) and Hydra's topology file in
/tmp (`hydra_hwloc_xmlfile_*`, removed by its proxy unless the proxy is SIGKILLed), and each job
its async stage dir (`<tmp>/es-ckpt-<job>`). The causes are fixed where they arise: a rank
unlinks MPICH's names once every rank has mapped them (`worker.dist.mpi_world`), a teardown kills
the ranks before their launcher (`processes.kill_order`) and removes the segments its ranks still
mapped (a rank killed inside MPI_Init: `mapped_segments`, `remove_unheld`), and the job removes
its stage dir when it ends (here). What can still slip through (a rank SIGKILLed by
something else inside MPI_Init, a supervisor killed outright, a run from before these fixes) is
swept: at a job's start and end, this user's
MPICH segments and Hydra topology files that no live process maps or holds open are removed.

`stage_dir`, `sweepable` and `orphans` decide; `held_paths` looks; `sweep` and
`remove_stage_dir` act.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import Any

from contracts import scratch

# Names of what MPICH (ch4 posix shared memory) and Hydra (its proxy's hwloc topology) put on a
# node; `worker.dist.MPI_SHM_PREFIXES` names the first for the ranks.
SHM_ROOT = "/dev/shm"
SHM_PREFIXES = ("mpich_shm_", "mpich_vci_")
HYDRA_TMP = "/tmp"  # Hydra's proxy writes here whatever TMPDIR says
HYDRA_PREFIXES = ("hydra_hwloc_xmlfile_",)
# The worker's default async stage dir (worker.ckpt.async_save.default_stage_root) under the
# supervisor: `<temp dir>/es-ckpt-<job id>`.
STAGE_PREFIX = "es-ckpt-"
# A sweep leaves files younger than this: what a job starting beside us makes is not yet ours to
# judge.
MIN_AGE_S = 60.0


# --- decisions ------------------------------------------------------------------------------------
def temp_dir(env: Mapping[str, str]) -> str:
    """The temp dir of a process with environment `env` (as `tempfile.gettempdir` would find it
    there: TMPDIR, TEMP, TMP when a directory, else this process's own)."""
    for name in ("TMPDIR", "TEMP", "TMP"):
        value = env.get(name)
        if value and os.path.isdir(value):
            return os.path.abspath(value)
    return tempfile.gettempdir()


def stage_dir(worker_flags: Mapping[str, Any], env: Mapping[str, str], job_id: str) -> str | None:
    """The async stage dir the job's ranks on this node make by default, or None: no async
    checkpoints, or a stage dir the user named (theirs to keep; the ranks empty it at start)."""
    if not worker_flags.get("async_ckpt") or worker_flags.get("ckpt_stage_dir"):
        return None
    return os.path.join(temp_dir(env), STAGE_PREFIX + scratch.scratch_tag(job_id))


def sweepable(name: str, st: os.stat_result, uid: int, prefixes: tuple[str, ...]) -> bool:
    """An entry a sweep may remove if nothing holds it: a plain file (its lstat: never a
    symlink) named like MPICH's or Hydra's, owned by `uid`."""
    return name.startswith(prefixes) and stat.S_ISREG(st.st_mode) and st.st_uid == uid


def orphans(candidates: Iterable[str], held: set[str]) -> list[str]:
    """Pure: the candidates that no live process maps or holds open."""
    return sorted(p for p in candidates if p not in held)


# --- looking --------------------------------------------------------------------------------------
def held_paths(
    proc_root: str = "/proc", cwd: bool = False, skip_pid: int | None = None
) -> set[str]:
    """Every file some process we can read (but `skip_pid`) maps or holds open now (unlinked
    ones too, by their old name); with `cwd`, every such process's working directory too."""
    held: set[str] = set()
    try:
        pids = [p for p in os.listdir(proc_root) if p.isdigit() and p != str(skip_pid)]
    except OSError:
        return held
    for pid in pids:
        if cwd:
            try:
                held.add(os.readlink(f"{proc_root}/{pid}/cwd").removesuffix(" (deleted)"))
            except OSError:
                pass
        try:
            with open(f"{proc_root}/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].startswith("/"):
                        held.add(parts[5].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            pass
        try:
            fds = os.listdir(f"{proc_root}/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                held.add(os.readlink(f"{proc_root}/{pid}/fd/{fd}").removesuffix(" (deleted)"))
            except OSError:
                continue
    return held


def _candidates(root: str, prefixes: tuple[str, ...], uid: int, before: float) -> list[str]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = []
    for name in names:
        if not name.startswith(prefixes):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
            if sweepable(name, st, uid, prefixes) and st.st_mtime < before:
                found.append(path)
        except OSError:
            continue
    return found


def mapped_segments(pids: Iterable[int], proc_root: str = "/proc") -> set[str]:
    """The MPICH segments these processes map and have not unlinked yet. Read before a
    teardown: a rank killed before every rank was past MPI_Init (a hang there, a slow start)
    never unlinked them, and the sweep leaves files younger than MIN_AGE_S."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"{proc_root}/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) < 6 or parts[5].rstrip("\n").endswith(" (deleted)"):
                        continue
                    path = parts[5].rstrip("\n")
                    if path.startswith(SHM_ROOT + "/") and os.path.basename(path).startswith(
                        SHM_PREFIXES
                    ):
                        found.add(path)
        except OSError:
            continue
    return found


# --- acts -----------------------------------------------------------------------------------------
def remove_unheld(paths: Iterable[str], proc_root: str = "/proc") -> list[str]:
    """Unlink those of `paths` that no live process maps or holds open any more (after the
    teardown of the attempt that mapped them); return what was removed."""
    paths = sorted(p for p in paths if os.path.lexists(p))
    if not paths:
        return []
    removed = []
    for path in orphans(paths, held_paths(proc_root)):
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def sweep(
    roots: Iterable[tuple[str, tuple[str, ...]]] = (
        (SHM_ROOT, SHM_PREFIXES),
        (HYDRA_TMP, HYDRA_PREFIXES),
    ),
    proc_root: str = "/proc",
    min_age_s: float = MIN_AGE_S,
) -> list[str]:
    """Remove this user's MPICH segments and Hydra topology files that no live process maps or
    holds open; return the paths removed. The candidates are listed before the processes are
    read, so one made meanwhile is not among them, and one listed is held from its creation
    (shm_open, mkstemp) until its maker ends or removes it. Only files older than `min_age_s`:
    another job starting on the node may hold its own only a moment after making them."""
    uid, before = os.getuid(), time.time() - min_age_s
    candidates = [p for root, prefixes in roots for p in _candidates(root, prefixes, uid, before)]
    return remove_unheld(candidates, proc_root)


def remove_stage_dir(path: str) -> str | None:
    """Remove the job's stage dir; None when it is gone, else why not."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename or path})"
    return None

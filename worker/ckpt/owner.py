"""One job per checkpoint dir, from the worker's side (`contracts.locks.lock_dir`).

A supervisor holds its checkpoint dir's lock for the job's life; a worker started by hand on
that directory would resume from the job's checkpoints and its retention would delete them
mid-save, so it is refused. A worker run without a supervisor holds the lock itself (rank 0),
so a supervisor started on its directory is refused in turn. No torch here.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from contracts import env_names, locks
from worker.errors import UsageError

_held: list[int] = []  # the lock's descriptor, open for the process's life
# A job that has just ended may still hold the lock for a moment: its launcher returned while a
# killed rank was still exiting (seen: a run by hand refused right after the one before it).
ENDING_WAIT_S = 3.0
POLL_S = 0.1


def refuse_if_owned(ckpt_dir: Path, wait_s: float = ENDING_WAIT_S) -> None:
    """Before any collective: a UsageError when another job owns `ckpt_dir` (still, after
    `wait_s`: a job ending as this one starts lets go of it)."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = locks.lock_holder(ckpt_dir)
        if holder is None or holder.get("job") == os.environ.get(env_names.ENV_JOB_ID):
            return
        if time.monotonic() >= deadline:
            raise UsageError(_in_use(ckpt_dir, holder))
        time.sleep(POLL_S)


def hold_if_alone(ckpt_dir: Path, rank: int) -> None:
    """Rank 0 of a run without a supervisor takes the lock; call it once every rank has passed
    `refuse_if_owned` (after the process group formed), so no peer finds its own job's lock."""
    if rank != 0 or os.environ.get(env_names.ENV_JOB_ID) or _held:
        return
    me = {"job": f"worker.train-{os.getpid()}", "host": socket.gethostname(), "pid": os.getpid()}
    try:
        _held.append(locks.lock_dir(ckpt_dir, me))
    except locks.DirInUse as exc:
        raise UsageError(_in_use(ckpt_dir, exc.holder)) from None


def _in_use(ckpt_dir: Path, holder: dict) -> str:
    return (
        f"--ckpt-dir {ckpt_dir} is in use by job {holder.get('job', '?')} (pid "
        f"{holder.get('pid', '?')} on {holder.get('host', '?')}); wait for it to end or "
        "choose another --ckpt-dir"
    )

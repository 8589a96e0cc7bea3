"""One job per run dir and per checkpoint dir, held for the job's whole life.

Two supervisors on one run dir interleave attempts and events; on one checkpoint dir, one job's
retention deletes the other's saves mid-write and each resumes from the other's checkpoints.
The lock is an flock (`locks.lock_dir`): the kernel releases it however the supervisor ends,
so there is never a stale lock to clear by hand.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from contracts import locks
from supervisor.settings.config import ConfigError


def claim(run_dir: Path, ckpt_dir: str | None, job_id: str, name: str) -> list[int]:
    """Lock the run dir and the checkpoint dir; the descriptors must stay open for the job's
    life. Raise ConfigError (exit 2) naming the holder, or an unwritable directory."""
    holder = {
        "job": job_id,
        "name": name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "run_dir": str(run_dir),
        "since": round(time.time(), 3),
    }
    dirs = [("run dir", run_dir)]
    if ckpt_dir:
        dirs.append(("checkpoint dir", Path(ckpt_dir)))
    fds: list[int] = []
    try:
        for label, path in dirs:
            fds.append(_lock(label, path, holder))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _lock(label: str, path: Path, holder: dict) -> int:
    try:
        return locks.lock_dir(path, holder)
    except locks.DirInUse as exc:
        raise ConfigError(str(path), "", f"{label} in use: {describe(exc.holder)}") from None
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ConfigError(
            str(path), "", f"{label} cannot be written ({why}); choose a writable directory"
        ) from None


def describe(holder: dict) -> str:
    """`job debug-1a2b (pid 42 on node7, since 09:13:40); wait for it to end or choose another`."""
    since = holder.get("since")
    when = time.strftime(", since %H:%M:%S", time.localtime(since)) if since else ""
    who = f"job {holder.get('job', '?')} (pid {holder.get('pid', '?')} on "
    return f"{who}{holder.get('host', '?')}{when}); wait for it to end or choose another directory"

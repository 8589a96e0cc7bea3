"""One job per run dir and per checkpoint dir, held for the job's whole life.

Two supervisors on one run dir interleave attempts and events; on one checkpoint dir, one job's
retention deletes the other's saves mid-write and each resumes from the other's checkpoints.
The lock is an flock (`locks.lock_dir`): the kernel releases it however the supervisor ends,
so there is never a stale lock to clear by hand.
"""

from __future__ import annotations

import grp
import os
import socket
import time
from pathlib import Path

from contracts import locks
from supervisor.policy.access import Access, access_for
from supervisor.settings.config import ConfigError

PRIVATE = access_for("")  # the default: the user's alone


def claim(
    run_dir: Path, ckpt_dir: str | None, job_id: str, name: str, access: Access = PRIVATE
) -> list[int]:
    """Make the run dir and the checkpoint dir with the job's `access` where they are missing,
    and lock them; the descriptors must stay open for the job's life. Raise ConfigError (exit 2)
    naming the holder, or an unwritable directory."""
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
            fds.append(_lock(label, path, holder, access))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _lock(label: str, path: Path, holder: dict, access: Access) -> int:
    try:
        make_dir(path, access)
        return locks.lock_dir(path, holder)
    except locks.DirInUse as exc:
        raise ConfigError(str(path), "", f"{label} in use: {describe(exc.holder)}") from None
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ConfigError(
            str(path), "", f"{label} cannot be written ({why}); choose a writable directory"
        ) from None


def make_dir(path: Path, access: Access) -> None:
    """Create `path` and its missing parents with the job's access: the mode, and the group when
    shared (setgid: what is written below takes it). A directory that exists keeps its own."""
    missing: list[Path] = []
    at = path
    while not at.exists():
        missing.append(at)
        at = at.parent
    gid = grp.getgrnam(access.group).gr_gid if access.group else -1
    for made in reversed(missing):
        try:
            made.mkdir(mode=access.dir_mode & 0o777)
        except FileExistsError:  # made meanwhile, by someone else: theirs to say
            continue
        if gid != -1:
            os.chown(made, -1, gid)
        os.chmod(made, access.dir_mode)  # the setgid bit, which mkdir's mode does not set


def group_problem(group: str) -> str | None:
    """Why the job cannot share its directories with `group` (None: it can): no such group
    here, or one this user is not in (its directories could not be given to it)."""
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return f"no group {group!r} on this host; name a group you are in (`id -Gn` lists them)"
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        return f"you are not in group {group!r}; name a group you are in (`id -Gn` lists them)"
    return None


def describe(holder: dict) -> str:
    """`job debug-1a2b (pid 42 on node7, since 09:13:40); wait for it to end or choose another`."""
    since = holder.get("since")
    when = time.strftime(", since %H:%M:%S", time.localtime(since)) if since else ""
    who = f"job {holder.get('job', '?')} (pid {holder.get('pid', '?')} on "
    return f"{who}{holder.get('host', '?')}{when}); wait for it to end or choose another directory"

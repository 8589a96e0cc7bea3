"""Who owns a directory: an flock held for a process's whole life.

One job per run dir and checkpoint dir (exclusive), and the memory tier's per-job directory
held shared by whoever uses it, so a sweep can tell an abandoned one.
"""

from __future__ import annotations

import fcntl
import json
import os
from typing import Any

# --- who owns a directory ------------------------------------------------------------------------
# One job per run dir and per checkpoint dir: its owner holds an flock on this file for its whole
# life (the kernel drops it when the owner dies, however it dies) and writes who it is into it.
LOCK_FILE = ".es-lock"


class DirInUse(Exception):
    """The directory's lock is held; `holder` is what its owner wrote (may be empty)."""

    def __init__(self, path: str, holder: dict[str, Any]) -> None:
        self.path, self.holder = path, holder
        who = ", ".join(f"{k} {holder[k]}" for k in ("job", "host", "pid") if k in holder)
        super().__init__(f"{path} is in use by another job ({who or 'owner unknown'})")


def lock_dir(path: str | os.PathLike, holder: dict[str, Any]) -> int:
    """Take `path`'s lock for as long as the returned descriptor stays open (not inherited by
    children), or raise DirInUse naming the owner."""
    os.makedirs(path, exist_ok=True)
    fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirInUse(str(path), read_lock_holder(path)) from None
    body = json.dumps(holder).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, body, 0)
    return fd


def lock_holder(path: str | os.PathLike) -> dict[str, Any] | None:
    """Who holds `path`'s lock now, or None when nobody does (or there is no lock file)."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_lock_holder(path)
    finally:
        os.close(fd)  # also drops the shared lock taken to test it
    return None


def read_lock_holder(path: str | os.PathLike) -> dict[str, Any]:
    """What the owner wrote (JSON, never unpickled); {} when unreadable."""
    try:
        with open(os.path.join(path, LOCK_FILE), "rb") as f:
            data = json.loads(f.read(4096) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def hold_mem_dir(path: str | os.PathLike) -> int:
    """Create `path` (0700) if needed and hold it shared for as long as the returned descriptor
    stays open (not inherited by children)."""
    lock = os.path.join(path, LOCK_FILE)
    for _ in range(5):  # a sweep may remove the directory between our open and our lock
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise OSError(f"{path} keeps being removed while it is taken")


def take_if_abandoned(path: str | os.PathLike) -> int | None:
    """An exclusive hold on `path` when no live process holds it (its owner died), else None."""
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        fd = None
    except OSError:
        return None
    if fd is None:  # never held (or its lock file gone): nobody can be holding it
        try:
            fd = os.open(
                os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
        except OSError:
            return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd

"""Which of the machine's processes belong to a host, found by their namespaces (every process
of every host is on this one kernel), and ending them all."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

from testbed.commands import BedError


def ns_inode(pid: int, kind: str) -> int | None:
    """The inode of `pid`'s namespace of `kind` (net, mnt, pid, uts); None when it is gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None


def is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def command_lines() -> Iterator[tuple[int, bytes]]:
    """Every other process's pid and command line (its words NUL-ended); one gone is skipped."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                yield int(entry), f.read()
        except OSError:
            continue


def members(kind: str, inodes: set[int]) -> list[int]:
    """The live processes whose namespace of `kind` is one of `inodes` (a zombie has ended: it
    waits only for its parent to read its status)."""
    if not inodes:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and ns_inode(int(entry), kind) in inodes and not is_zombie(int(entry)):
            found.append(int(entry))
    return found


def kill_init(pid: int, pidns: int) -> None:
    """SIGKILL a host's init, which the kernel follows by SIGKILL to every process of its PID
    namespace at once. Checked through a pidfd, so a reused pid is never hit."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if ns_inode(pid, "pid") == pidns:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)


def sweep(kinds: dict[str, set[int]], timeout: float = 10.0) -> None:
    """SIGKILL every process in any of the namespaces (`kind` -> inodes) until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = sorted({p for kind, inodes in kinds.items() for p in members(kind, inodes)})
        if not left:
            return
        if time.monotonic() > deadline:
            raise BedError(f"processes {left[:10]} still run after {timeout:g} s of SIGKILL")
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)

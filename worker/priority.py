"""Work that must not take the cores from the ranks that train: a standby's preparation, the
memory tier's copy. Linux weighs CPU in two ways, and a rank meets both:

- **Threads by their nice value** (`lowest_priority`: nice 19 for the calling thread only).
  It counts against the threads of the same scheduling group.
- **Autogroups.** Where the kernel groups each session's threads (`/proc/self/autogroup`,
  `kernel.sched_autogroup_enabled`, tasks not in a cgroup of their own), a group against
  another is weighed by the group's nice, whatever the nice of its threads. The launcher (and
  the fork template) gives each rank a session of its own, so a standby's thread at nice 19
  took as much of a core as a training rank did (measured once each, the debug preset's 2
  ranks on 2 cores, 40 s: 69-79 steps alone, 47 beside a nice-19 spinner in a session of its
  own, 62 beside one whose session was at nice 19).
  `lowest_session` lowers the whole process's group while it prepares and gives the nice back
  after: raising an autogroup's nice back to what it was needs no privilege (only below 0
  does), but the kernel takes one change a 100 ms on the whole host from an unprivileged
  process, so a change is retried for a while.

A standby's preparation is not moved to a thread at nice 19 where there are no autogroups: its
warm-up must run in the thread that trains (DTensor keeps its sharding cache per thread).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

LOWEST = 19
AUTOGROUP = Path("/proc/self/autogroup")
RETRY_S = 0.02
RETRY_FOR_S = 2.0  # the host's one change a 100 ms, with every rank of the node asking


def lowest_priority() -> None:
    """Nice 19 for the calling thread (Linux sets it per thread); the rest of the process keeps
    its priority. Not SCHED_IDLE: on a host that other work keeps busy, a thread starved while
    it holds the GIL would hold the training thread for as long (nice 19 still gets a share)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST)
    except (AttributeError, OSError):  # not Linux: the process's priority
        pass


def autogroup_nice(text: str) -> int | None:
    """Pure: the nice of `/proc/<pid>/autogroup` (`/autogroup-42 nice 0`); None if unreadable."""
    parts = text.split()
    if len(parts) != 3 or parts[1] != "nice":
        return None
    try:
        return int(parts[2])
    except ValueError:
        return None


def set_session_nice(nice: int, retry_for_s: float = RETRY_FOR_S) -> bool:
    """This process's autogroup at `nice`: True once written; False where there is none or the
    kernel refuses (retried while it says "again", for `retry_for_s`)."""
    deadline = time.monotonic() + retry_for_s
    while True:
        try:
            AUTOGROUP.write_text(str(nice))
            return True
        except OSError as exc:
            if exc.errno != errno.EAGAIN or time.monotonic() >= deadline:
                return False
        time.sleep(RETRY_S)


@contextlib.contextmanager
def lowest_session() -> Iterator[None]:
    """This process's autogroup at nice 19 inside the block, its nice before after it (where
    there is no autogroup, nothing changes). Whether the nice came back is not waited on past
    `RETRY_FOR_S`: a rank that could not get it back trains at its session's nice 19, which
    costs it only against other work at a higher priority on the node."""
    try:
        before = autogroup_nice(AUTOGROUP.read_text())
    except OSError:
        before = None
    lowered = before is not None and before < LOWEST and set_session_nice(LOWEST)
    try:
        yield
    finally:
        if lowered:
            set_session_nice(before)

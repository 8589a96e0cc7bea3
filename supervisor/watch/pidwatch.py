"""The moment each local rank's process ends, from a pidfd on the event loop.

A rank is a grandchild (under mpiexec or srun), so `waitpid` cannot see it; polling its pid
every check saw a SIGKILLed rank and the ranks the launcher then killed in the same check, and
which rank went first is what lays a failure on a node. A pidfd turns readable the moment the
process exits: the order is kept to the millisecond.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable


class ExitWatch:
    """Calls `on_exit(rank, monotonic time)` once per watched rank whose process ended."""

    def __init__(self, on_exit: Callable[[int, float], None]) -> None:
        self.on_exit = on_exit
        self._fds: dict[int, int] = {}  # rank -> pidfd

    def add(self, rank: int, pid: int) -> bool:
        """Watch `pid` as `rank`; False where pidfds are not to be had (then polling stays)."""
        if rank in self._fds or not hasattr(os, "pidfd_open"):
            return False
        try:
            fd = os.pidfd_open(pid)
        except OSError:  # gone already (the poll sees it), or no pidfd on this kernel
            return False
        try:
            asyncio.get_running_loop().add_reader(fd, self._ended, rank)
        except (RuntimeError, OSError, ValueError):
            os.close(fd)
            return False
        self._fds[rank] = fd
        return True

    def watching(self, rank: int) -> bool:
        return rank in self._fds

    def _ended(self, rank: int) -> None:
        now = time.monotonic()
        self._drop(rank)
        self.on_exit(rank, now)

    def _drop(self, rank: int) -> None:
        fd = self._fds.pop(rank, None)
        if fd is None:
            return
        with contextlib.suppress(RuntimeError, ValueError, OSError):
            asyncio.get_running_loop().remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)

    def close(self) -> None:
        for rank in list(self._fds):
            self._drop(rank)

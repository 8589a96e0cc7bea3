"""The ends of an attempt's ranks on this host, seen at once rather than at their next missed
beat: a pidfd per rank that said hello here (`ExitWatch`, to the millisecond), else a `kill 0`
at each check (a rank under mpiexec or srun), and the launcher's own word on a process it
started."""

from __future__ import annotations

import os
import time

from supervisor.launch import hosts
from supervisor.watch.pidwatch import ExitWatch
from supervisor.watch.rank_table import AttemptTable


class LocalExits:
    """Marks this host's ranks of `table` exited the moment their process is gone."""

    def __init__(self, table: AttemptTable) -> None:
        self.table = table
        self.pidfds = ExitWatch(self._pid_ended)

    def watch(self, rank: int, pid: int) -> None:
        """A rank said hello from this host: watch its process."""
        self.pidfds.add(rank, pid)

    def check(self, now: float) -> None:
        """A rank on this host whose process is gone (under mpiexec or srun) is seen at once;
        those with a pidfd say so themselves, the moment they end."""
        for st in self.table.on_host(hosts.this_host()):
            if st.pid and not st.exited and not self.pidfds.watching(st.rank):
                try:
                    os.kill(st.pid, 0)
                except ProcessLookupError:
                    self.table.exited(st, now)
                except PermissionError:
                    continue

    def pids(self) -> list[int]:
        """The pids of the ranks on this host (for the teardown)."""
        return self.table.local_pids(hosts.this_host())

    def launcher_saw_exit(self, rank: int, rc: int) -> None:
        """The launcher reaped a rank's process (`rc`: its exit status)."""
        now = time.monotonic()
        self.table.exited(self.table.state(rank, now), now)

    def close(self) -> None:
        self.pidfds.close()

    def _pid_ended(self, rank: int, when: float) -> None:
        """When a local rank's process ended, to the millisecond (the next check judges it, as
        before: the launcher's own exit usually comes first and says more, and a teardown begun
        while the launcher still cleans up cost Hydra's proxies their own clean-up)."""
        st = self.table.ranks.get(rank)
        if st is not None and not st.exited:
            self.table.exited(st, when)

"""The CPU time of some of this process's threads: the memory tier's (its copy thread and copy
worker, the partner link's sender, receiver and ZeroMQ I/O threads). Where the training keeps
every core busy (a job on CPU), what they run is taken from the steps beside them without
stalling the loop, so a copy's cost is its stall plus this (`tier.CopyReport.background_seconds`)
times the ranks whose threads do the same on the same cores (`cpu_sharers`).

Read from `/proc/self/task/<tid>/schedstat` (the time on a CPU, in ns): any thread, ours or
libzmq's, at full resolution. Where there is no /proc, nothing is counted.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Iterable, Sequence


def runtime_s(tid: int) -> float | None:
    """Seconds thread `tid` of this process has run on a CPU; None when it is gone (or no /proc)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


class ThreadCpu:
    """A set of threads' CPU seconds, those that ended included (at their last reading: a
    thread that retires itself is read as it ends), so that the total never goes back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, float] = {}  # tid -> its runtime when last read
        self._gone = 0.0  # the threads that ended

    def add(self, tids: Iterable[int]) -> None:
        with self._lock:
            for tid in tids:
                self._live.setdefault(tid, 0.0)

    def add_current(self) -> None:
        """The calling thread (a thread pool's initializer, a thread's first line)."""
        self.add([threading.get_native_id()])

    def retire_current(self) -> None:
        """The calling thread ends: its runtime now is its last (its tid may be reused)."""
        tid = threading.get_native_id()
        spent = runtime_s(tid)
        with self._lock:
            self._gone += max(self._live.pop(tid, 0.0), spent or 0.0)

    def seconds(self) -> float:
        with self._lock:
            for tid, last in list(self._live.items()):
                spent = runtime_s(tid)
                if spent is None:  # ended without retiring: at its last reading
                    self._gone += self._live.pop(tid)
                else:
                    self._live[tid] = max(last, spent)
            return self._gone + sum(self._live.values())


def cpu_sharers(affinity: int, threads: int, host_affinities: Sequence[int]) -> int:
    """Pure: how many ranks' tier CPU one rank's stands for in what a copy costs the steps.
    `affinity`: the cores this rank may run on, as a bit mask; `host_affinities`: those of the
    job's ranks on its host, its own included. The ranks whose cores overlap its own share them;
    where they want more of those cores than there are (ranks x `threads` > cores), a rank's tier
    threads, while their own rank waits in a collective, take a core another rank's training
    wanted, and the ranks step together: each one's delay holds all of them up at the next
    collective (3 ranks on 2 cores, a copy every step: the steps lost about 3 times rank 0's
    stall and CPU, the stall a few ms of it; the stall is a wait they share, counted once).
    With cores to spare the threads run there, and with its cores its own (pinned) a rank's
    threads delay only its steps: its own CPU stands for the copy. So it does where the ranks
    just fill the cores (2 ranks on 2 cores), as before: counted twice there, the kills soak did
    no better, within the host's swings (docs/benchmarks.md, soak.py)."""
    sharing = [a for a in host_affinities if a & affinity] or [affinity]
    cores = bin(functools.reduce(operator.or_, sharing, affinity)).count("1")
    return len(sharing) if len(sharing) * threads > cores else 1

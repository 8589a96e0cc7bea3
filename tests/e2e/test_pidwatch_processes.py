"""The moment a process that is not our child ends, from a pidfd on the event loop (real
processes, real signals): the order of ends is what lays a failure on a node."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

from supervisor.watch.pidwatch import ExitWatch


def test_ends_are_seen_at_once_and_in_order():
    async def main() -> list[tuple[int, float]]:
        procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                 for _ in range(3)]  # fmt: skip
        seen: list[tuple[int, float]] = []
        watch = ExitWatch(lambda rank, when: seen.append((rank, when)))
        try:
            assert all(watch.add(rank, p.pid) for rank, p in enumerate(procs))
            assert not watch.add(0, procs[0].pid)  # once per rank
            os.kill(procs[1].pid, signal.SIGKILL)
            for _ in range(500):  # its end seen (a killed process ends when it is next run)
                if seen:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            for p in (procs[2], procs[0]):
                os.kill(p.pid, signal.SIGKILL)
            for _ in range(100):
                if len(seen) == 3:
                    break
                await asyncio.sleep(0.01)
        finally:
            watch.close()
            for p in procs:
                p.kill()
                p.wait()
        return seen

    seen = asyncio.run(main())
    assert [rank for rank, _ in seen][0] == 1 and sorted(r for r, _ in seen) == [0, 1, 2]
    assert seen[1][1] - seen[0][1] >= 0.04  # the first end, 50 ms before the others


def test_a_pid_already_gone_is_not_watched():
    async def main() -> bool:
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        p.wait()
        return ExitWatch(lambda r, t: None).add(0, p.pid)

    assert asyncio.run(main()) is False

"""The user's requests to stop the job (SIGINT, SIGTERM or SIGHUP to the supervisor), counted.

The first asks the running attempt's ranks to save and stop; a second cuts their grace short.
Any number of waiters (an attempt, the backoff, a standby) can wait for "more than n requests".
"""

from __future__ import annotations

import asyncio
import signal


def stop_signals() -> tuple[signal.Signals, ...]:
    """The signals that ask for a graceful stop: SIGINT, SIGTERM, and SIGHUP (a closed terminal,
    an SSH drop), unless SIGHUP is ignored: a supervisor started under `nohup` is meant to
    outlive its terminal."""
    found = [signal.SIGINT, signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        found.append(signal.SIGHUP)
    return tuple(found)


class StopRequests:
    """The stop requests so far (`count`), and a wait for the next ones."""

    def __init__(self) -> None:
        self.count = 0
        self._next = asyncio.Event()  # set (and replaced) at each request

    def request(self) -> None:
        self.count += 1
        ev, self._next = self._next, asyncio.Event()
        ev.set()

    async def more_than(self, n: int) -> None:
        """Returns once more than `n` stops were requested (at once if they already were)."""
        while self.count <= n:
            await self._next.wait()

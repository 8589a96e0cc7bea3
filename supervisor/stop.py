"""The user's requests to stop the job (SIGINT/SIGTERM to the supervisor), counted.

The first asks the running attempt's ranks to save and stop; a second cuts their grace short.
Any number of waiters (an attempt, the backoff, a standby) can wait for "more than n requests".
"""

from __future__ import annotations

import asyncio


class StopRequests:
    def __init__(self) -> None:
        self.count = 0
        self._next = asyncio.Event()  # set (and replaced) at each request

    def request(self) -> None:
        self.count += 1
        ev, self._next = self._next, asyncio.Event()
        ev.set()

    async def beyond(self, n: int) -> None:
        """Returns once more than `n` stops were requested (at once if they already were)."""
        while self.count <= n:
            await self._next.wait()

"""The warm standby: the next attempt's ranks, started beside the running one and kept waiting.

A failure then costs the load and one warm step instead of a cold start (imports, process group,
model build, a cold first step). The keeper starts a standby once the running attempt has made
its first step (so it never slows a start), watches it (liveness; no progress limit while it
waits), replaces one that is lost after a backoff without spending the restart budget, and hands
it over on a failure (`take`). `close` leaves no standby process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

from supervisor.policy import standby_rules
from supervisor.run.attempt import Attempt
from supervisor.run.context import JobContext


class StandbyKeeper:
    """Keeps at most one standby attempt alive and ready."""

    def __init__(
        self,
        job: JobContext,
        next_number: Callable[[], int],
        route: Callable[[Attempt], None],
        unroute: Callable[[Attempt], None],
    ) -> None:
        self.job = job
        self.next_number = next_number
        self.route, self.unroute = route, unroute
        self.attempt: Attempt | None = None
        self._task: asyncio.Task | None = None
        self._starting: asyncio.Future | None = None  # a launch under way
        self._ending: asyncio.Future | None = None  # a lost standby's teardown under way
        self.lost_in_a_row = 0
        self.given_up = False
        self.over = False  # the job is over: keep none from now on

    def ensure(self) -> None:
        """Keep a standby from now on (the running attempt has stepped)."""
        if self._task is None and not self.given_up and not self.over:
            self._task = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        schedule = self.job.resolved.cfg.restart.backoff_s
        while True:
            attempt = self.attempt = Attempt(self.next_number(), self.job, standby=True)
            self.route(attempt)
            self._starting = asyncio.ensure_future(attempt.start())
            started = await asyncio.shield(self._starting)
            if started:
                why = await attempt.wait_as_standby()
            else:
                why = f"cannot start: {attempt.launch_error}"
            self.lost_in_a_row = 0 if attempt.ready_at is not None else self.lost_in_a_row + 1
            delay = standby_rules.standby_retry_delay(max(1, self.lost_in_a_row), schedule)
            self.job.emit(
                "standby_lost",
                attempt=attempt.number,
                reason=why,
                was_ready=attempt.ready_at is not None,
                retry_in_s=delay,
            )
            self.attempt = None
            self._ending = asyncio.ensure_future(self._end(attempt, "lost"))
            await asyncio.shield(self._ending)  # a close meanwhile waits for it
            if delay is None:
                self.given_up = True
                self.job.emit("standby_off", reason=f"{self.lost_in_a_row} standbys lost in a row")
                return
            await asyncio.sleep(delay)

    async def take(self, bad_nodes: Sequence[str] = ()) -> tuple[Attempt | None, str | None]:
        """The standby for the next attempt, or (None, why a cold launch instead). A standby
        that cannot be used is ended; in both cases the keeper starts over at `ensure`."""
        attempt = self.attempt
        alive = attempt is not None and attempt.running is not None
        why = standby_rules.standby_unusable(
            ready=attempt is not None and attempt.ready_at is not None,
            alive=alive,
            standby_nodes=attempt.running.plan.nodes if alive else [],
            bad_nodes=bad_nodes,
        )
        if self.given_up:
            why = "standbys kept failing: off for this job"
        if why is not None:
            await self.close("unusable")
            return None, why
        await self._stop_keeping()
        self.attempt = None
        return attempt, None

    async def _stop_keeping(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self, reason: str, for_good: bool = False) -> None:
        """End the standby (if any) and keep none until `ensure` (never again: `for_good`)."""
        self.over = self.over or for_good
        await self._stop_keeping()
        if self._ending is not None:
            await self._ending
        attempt, self.attempt = self.attempt, None
        if attempt is None:
            return
        if self._starting is not None and not self._starting.done():
            with contextlib.suppress(Exception):
                await self._starting  # a launch under way: let it finish, then end it
        await self._end(attempt, reason)

    async def _end(self, attempt: Attempt, reason: str) -> None:
        await attempt.end_standby(reason)
        self.unroute(attempt)

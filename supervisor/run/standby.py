"""The warm standby: the next attempt's ranks, started beside the running one and kept waiting.

A failure then costs the load and one warm step instead of a cold start (imports, process group,
model build, a cold first step). The keeper starts a standby once the running attempt has made
its first step, or has redone the few steps a failure cost it (so it never slows a start nor a
recovery: `StandbyStart`), watches it (liveness; no progress limit while it
waits), replaces one that is lost after a backoff without spending the restart budget, and hands
it over on a failure (`take`). One not ready then is waited for when it is well along its start
(a cold launch would redo it), else dropped, never holding the cold launch up: where all its
ranks run here and have started, they are stopped at once (SIGSTOP), so that they take no more
CPU from the cold attempt starting beside them, and the standby is ended (SIGKILL and the
teardown) once that attempt starts the next standby; any other is ended at once (`close` waits
for every such ending). `close` leaves no standby process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable, Sequence

from supervisor.launch import hosts
from supervisor.policy import standby_rules
from supervisor.run.attempt import Attempt
from supervisor.run.context import JobContext
from supervisor.watch.rank_table import AttemptTable

READY_POLL_S = 0.02  # how often a wait for a standby still starting looks at it


class StandbyStart:
    """Starts the keeper's standby at the attempt's step the rules choose
    (`standby_rules.standby_start_step`): told each newest step the attempt reached."""

    def __init__(self, start: Callable[[], None], newest_before: int | None) -> None:
        self.start, self.newest_before = start, newest_before
        self.at: int | None = None  # chosen at the first step
        self.started = False

    def __call__(self, step: int) -> None:
        if self.started:
            return
        if self.at is None:
            self.at = standby_rules.standby_start_step(step, self.newest_before)
        if step >= self.at:
            self.started = True
            self.start()


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
        self._endings: set[asyncio.Future] = set()  # standbys' teardowns under way
        self._dropped: Attempt | None = None  # dropped at a failure: stopped, ended later
        self.prepare_s: float | None = None  # how long the last ready standby took to be ready
        self.waited_s = 0.0  # how long the last `take` waited for a standby still starting
        self.lost_in_a_row = 0
        self.lost_nodes: list[str] = []  # where the last standby lost ran (a node loss takes it)
        self.given_up = False
        self.over = False  # the job is over: keep none from now on
        self.newest_done: int | None = None  # the newest step any earlier attempt reached

    def starter(
        self, previous: Attempt | None, also: Callable[[], None] | None = None
    ) -> StandbyStart:
        """What starts the standby beside a new attempt (`previous` ran before it): at the
        step the rules choose from the newest step any earlier attempt of the job reached;
        `also` is called with it (the prepared ranks', launched once the standby is ready)."""
        if previous is not None and previous.table.max_step is not None:
            self.newest_done = max(self.newest_done or 0, previous.table.max_step)

        def start() -> None:
            self.ensure()
            if also is not None:
                also()

        return StandbyStart(start, self.newest_done)

    def ensure(self) -> None:
        """Keep a standby from now on (the running attempt has stepped); a standby dropped
        for it is ended now (its teardown first, the next standby's launch after it)."""
        self._end_dropped()
        if self._task is None and not self.given_up and not self.over:
            self._task = asyncio.get_running_loop().create_task(self._keep())

    async def _keep(self) -> None:
        schedule = self.job.resolved.cfg.restart.backoff_s
        while True:
            await self._ended()  # one standby's processes at a time
            attempt = self.attempt = Attempt(self.next_number(), self.job, standby=True)
            self.route(attempt)
            self._starting = asyncio.ensure_future(attempt.start())
            started = await asyncio.shield(self._starting)
            if started:
                why = await attempt.wait_as_standby()
            else:
                why = f"cannot start: {attempt.launch_error}"
            self._note_ready(attempt)
            self.lost_in_a_row = 0 if attempt.ready_at is not None else self.lost_in_a_row + 1
            delay = standby_rules.standby_retry_delay(max(1, self.lost_in_a_row), schedule)
            self.job.emit(
                "standby_lost",
                attempt=attempt.number,
                reason=why,
                was_ready=attempt.ready_at is not None,
                retry_in_s=delay,
            )
            self.attempt, self.lost_nodes = None, list(attempt.nodes)
            await asyncio.shield(self._end_later(attempt, "lost"))  # a close waits for it too
            if delay is None:
                self.given_up = True
                self.job.emit("standby_off", reason=f"{self.lost_in_a_row} standbys lost in a row")
                return
            await asyncio.sleep(delay)

    async def take(self, bad_nodes: Sequence[str] = ()) -> tuple[Attempt | None, str | None]:
        """The standby for the next attempt, or (None, why a cold launch instead). One still
        starting is waited for when the rules say so; one that cannot be used is dropped, its
        ending left to run beside the cold launch. Either way the keeper starts over at
        `ensure`."""
        self._end_dropped()  # one dropped at a failure before: its cold attempt never got far
        choice = self._choice(bad_nodes)
        self.waited_s = 0.0
        if choice.action == "wait":
            t0 = time.monotonic()
            await self._wait_ready(choice.wait_s)
            self.waited_s = round(time.monotonic() - t0, 6)
            choice = self._choice(bad_nodes)
        attempt = self.attempt
        await self._stop_keeping()
        self.attempt, self.lost_nodes = None, []
        if choice.action == "use":
            self._note_ready(attempt)
            return attempt, None
        if attempt is not None:
            self._drop(attempt)
        return None, choice.why

    def _drop(self, attempt: Attempt) -> None:
        """Stop the ranks of a standby that cannot be used (SIGSTOP: at once, and no CPU from
        now on) and end it once the cold attempt has made the step the next standby starts
        at (`ensure`), at the next failure or at `close`. Ended at once, its teardown (the
        ranks' exits, the launcher's) ran on the cores the cold attempt's imports needed. A
        stopped rank still dies with its launcher (its parent-death signal is SIGKILL). Only
        a standby whose every rank runs here, already started, can be stopped so; another is
        ended at once, as a rank left running would take the cores the longest."""
        pids = self._stoppable(attempt)
        if pids is None:
            self._end_later(attempt, "unusable")
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
        self._dropped = attempt

    def _stoppable(self, attempt: Attempt) -> list[int] | None:
        """The processes of `attempt`'s ranks, when every rank runs on this host and has
        started; else None."""
        running, emulated = attempt.running, self.job.resolved.cfg.launch.emulate_nodes
        if running is None or not (emulated or all(map(hosts.is_this_host, attempt.nodes))):
            return None
        pids = running.worker_pids()
        if self.job.resolved.template_off is None:  # forked by the templates: not in its tree
            pids += [st.pid for st in attempt.table.ranks.values() if st.pid]
            if len([st for st in attempt.table.ranks.values() if st.pid]) < attempt.table.world:
                return None
        return sorted(set(pids)) if len(pids) >= attempt.table.world else None

    @property
    def dropped(self) -> Attempt | None:
        """A standby dropped at the last failure, its ranks stopped until it is ended."""
        return self._dropped

    def tables(self) -> list[AttemptTable]:
        """The ranks of the standby and of a dropped one (stopped), for a fault that takes
        their node (`node_loss`)."""
        return [a.table for a in (self.attempt, self._dropped) if a is not None]

    def starting_nodes(self) -> set[str]:
        """The nodes of a standby launched or launching and not ready yet."""
        attempt = self.attempt
        if attempt is None or attempt.ready_at is not None:
            return set()
        return set(attempt.nodes)

    def _end_dropped(self) -> None:
        attempt, self._dropped = self._dropped, None
        if attempt is not None:
            self._end_later(attempt, "unusable", stopped=True)

    def _choice(self, bad_nodes: Sequence[str]) -> standby_rules.StandbyChoice:
        attempt = self.attempt
        if self.given_up:
            return standby_rules.StandbyChoice("drop", "standbys kept failing: off for this job")
        alive = attempt is not None and attempt.running is not None
        return standby_rules.standby_choice(
            ready=attempt is not None and attempt.ready_at is not None,
            alive=alive,
            standby_nodes=attempt.nodes if attempt is not None else self.lost_nodes,
            bad_nodes=bad_nodes,
            starting_s=time.monotonic() - attempt.table.launched_at if alive else 0.0,
            prepare_s=self.prepare_s,
        )

    async def _wait_ready(self, bound_s: float) -> None:
        """Until the standby is ready, lost, or `bound_s` has passed."""
        deadline = time.monotonic() + bound_s
        attempt, task = self.attempt, self._task
        while time.monotonic() < deadline and attempt is self.attempt and attempt is not None:
            if attempt.ready_at is not None or task is None or task.done():
                return
            await asyncio.sleep(READY_POLL_S)

    def _note_ready(self, attempt: Attempt | None) -> None:
        if attempt is not None and attempt.ready_at is not None:
            self.prepare_s = attempt.ready_at - attempt.table.launched_at

    def _end_later(self, attempt: Attempt, reason: str, stopped: bool = False) -> asyncio.Future:
        """End `attempt` in the background (a launch under way first finishes); `close` and the
        next standby wait for it."""
        starting = self._starting

        async def end() -> None:
            if starting is not None and not starting.done():
                with contextlib.suppress(Exception):
                    await starting  # a launch under way: let it finish, then end it
            await self._end(attempt, reason, stopped)

        ending = asyncio.ensure_future(end())
        self._endings.add(ending)
        ending.add_done_callback(self._endings.discard)
        return ending

    async def _ended(self) -> None:
        """Until every standby teardown under way is over. A wait that is cancelled (the
        keeper's task, at a take) leaves the teardowns running: `close` still waits for them."""
        while self._endings:
            await asyncio.wait(set(self._endings))

    async def _stop_keeping(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self, reason: str, for_good: bool = False) -> None:
        """End the standby (if any) and keep none until `ensure` (never again: `for_good`)."""
        self.over = self.over or for_good
        self._end_dropped()
        await self._stop_keeping()
        attempt, self.attempt = self.attempt, None
        if attempt is not None:
            self._end_later(attempt, reason)
        await self._ended()

    async def _end(self, attempt: Attempt, reason: str, stopped: bool = False) -> None:
        await attempt.end_standby(reason, stopped)
        self.unroute(attempt)
        if self.job.control is not None:  # its processes are gone: none claims them again
            self.job.control.forget(attempt.number)

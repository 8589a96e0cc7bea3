"""The end of an attempt's processes: the user's stop forwarded to its ranks, the teardown with
its events, and the MPICH segments killed ranks left behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.host import hygiene
from supervisor.launch.processes import Exit, TeardownResult
from supervisor.policy.liveness import Finding
from supervisor.run import attempt_events
from supervisor.run.context import Running
from supervisor.run.stop import StopRequests
from supervisor.watch.rank_table import AttemptTable


@dataclass
class WatchEnd:
    """How the watch ended, before teardown: `reason` is exit, stop or the finding's kind."""

    reason: str
    exit_task: asyncio.Task
    exit: Exit | None = None
    finding: Finding | None = None
    stopping: bool = False


def grace_for(end: WatchEnd, grace: float) -> float:
    """The SIGTERM grace of this teardown: none after a `hang` or `no_progress` finding, whose
    ranks are stopped or stuck in a step and its collectives (a SIGTERM's save would wait on the
    very rank that hangs), so the grace would only hold the relaunch up."""
    return 0.0 if end.finding is not None else grace


async def forward_stop(
    running: Running,
    exit_task: asyncio.Task,
    stop: StopRequests,
    grace: float,
    emit: Callable[..., None],
    table: AttemptTable,
    reason: str | None = None,
) -> Exit | None:
    """Forward the user's stop (or the supervisor's own, `reason` saying why); wait for the
    ranks to save and exit (or a second request)."""
    why = {"reason": reason} if reason else {}
    emit("stop", signal=running.plan.stop_signal.name, grace_s=grace, **why)
    running.signal_stop()
    second = asyncio.create_task(stop.more_than(1))
    done, _ = await asyncio.wait(
        {exit_task, second}, timeout=grace, return_when=asyncio.FIRST_COMPLETED
    )
    second.cancel()
    if exit_task in done:
        info = exit_task.result()
        emit("exit", **attempt_events.exit_fields(info, table, stopped=True))
        return info
    return None


async def tear_down(
    running: Running,
    end: WatchEnd,
    *,
    grace: float,
    rank_pids: Callable[[], list[int]],
    drain: Callable[[], object],
    emit: Callable[..., None],
    table: AttemptTable,
) -> TeardownResult:
    """What the ranks said last and the launcher's exit first, then end every process of the
    attempt (and collect the exit status if it came meanwhile)."""
    drain()  # what the ranks said just before they ended
    t_detect = time.monotonic()
    if end.exit is not None and not end.stopping:
        emit("exit", **attempt_events.exit_fields(end.exit, table))
    start = time.monotonic()
    since = end.exit.mono if end.exit else t_detect
    emit(
        "teardown",
        reason=end.reason,
        start_mono=round(start, 6),
        latency_s=round(start - since, 6),
    )
    result, segments = await end_processes(running, grace, rank_pids)
    emit(
        "teardown_done",
        seconds=round(result.seconds, 6),
        terminated=result.terminated,
        killed=result.killed,
        survivors=len(result.survivors),
        **({"segments_removed": segments} if segments else {}),
    )
    if end.exit is None and end.exit_task.done():
        end.exit = end.exit_task.result()
    if not end.exit_task.done():
        end.exit_task.cancel()
    return result


async def end_processes(
    running: Running, grace: float, rank_pids: Callable[[], list[int]]
) -> tuple[TeardownResult, list[str]]:
    """The launcher's teardown, then the MPICH segments its ranks still mapped (killed before
    every rank was past MPI_Init, they never unlinked them): removed here, where they arose,
    once no process holds them. `rank_pids`: the attempt's ranks on this host, as known now."""
    segments = hygiene.mapped_segments(rank_pids())
    result = await running.teardown(grace, rank_pids())
    return result, hygiene.remove_unheld(segments) if segments else []

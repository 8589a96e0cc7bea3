"""One attempt: start its ranks, watch them (or stop them), tear down, classify.

An attempt owns what lives and dies with one launch: its rank table, its processes, its watch
loop, its events. It returns what happened (`AttemptResult`); what to do next is the job's. Two
attempts may be alive at once (a warm standby beside the running one), so an attempt shares
nothing with another but the `JobContext` it is handed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.launch import hosts
from supervisor.launch.plan import LaunchPlan
from supervisor.launch.processes import TeardownResult
from supervisor.policy import error_lines, exits, nodes
from supervisor.policy.exits import Outcome
from supervisor.policy.liveness import Finding
from supervisor.policy.restarts import AttemptRecord
from supervisor.policy.stragglers import StragglerFinding
from supervisor.run import attempt_events, attribution, finding_stacks, prepared, teardown
from supervisor.run.context import JobContext, Running
from supervisor.run.prepared import Adopted
from supervisor.run.rank_watch import RankWatch
from supervisor.run.stop import StopRequests
from supervisor.run.stragglers import StragglerWatch
from supervisor.run.teardown import WatchEnd
from supervisor.watch.rank_table import AttemptTable

EXIT_FOLLOW_S = 0.1  # after a rank's process ended, how long to wait for the launcher's exit
# ... when that rank said why before any step without a `cause` (a worker other than ours): the
# launcher's exit status tells bad input (2) from a failure. Ranks forked from templates start no
# MPI, so no MPI_Abort ends the job at once: its launcher exits once every rank has ended. Our
# worker's `error` says `cause` `usage` with its exit 2, which decides without this wait.
EXIT_FOLLOW_SAID_S = 8.0
ABORT_GRACE_S = 0.5  # teardown grace when the supervisor itself fails mid-attempt
OUTPUT_READ_S = 1.0  # after teardown, how long to wait for the ranks' last output lines


class AttemptState(enum.Enum):
    """Where an attempt is in its life. A standby is STANDBY from its launch until `go`: faults,
    progress limits and the job leave it be."""

    STANDBY = "standby"  # launched beside the running attempt, waiting for `go`
    LAUNCHING = "launching"  # its ranks are being started
    RUNNING = "running"  # its ranks run, watched; faults may hit them
    ENDING = "ending"  # the watch is over, or the launch failed, or the standby is let go


@dataclass(frozen=True)
class AttemptResult:
    """What one attempt came to: its outcome, the finding that ended it (if one did), and its
    record for the job's history."""

    number: int
    outcome: Outcome
    finding: Finding | None
    record: AttemptRecord
    attribution: nodes.Attribution | None = None  # the node a failure is laid on, if any
    replace: StragglerFinding | None = None  # stopped to relaunch without this straggler's node


class Attempt:
    """One launch of the job's ranks, run once: `await Attempt(n, job).run(stop)`.

    A standby (`standby=True`) is started early (`start`), waits prepared (`wait_as_standby`)
    and becomes the running attempt on `go`; `run` then watches it like any other."""

    def __init__(
        self, number: int, job: JobContext, standby: bool = False, adopt: Adopted | None = None
    ) -> None:
        self.number = number
        self.job = job
        self.cfg = job.resolved.cfg
        self.dir = job.resolved.run_dir / "attempts" / f"{number:03d}"
        self.table = AttemptTable(number, job.resolved.world, time.monotonic(), self.cfg.heartbeat)
        self.watch = RankWatch(self.table, self.cfg.heartbeat, self.emit)
        self.state = AttemptState.STANDBY if standby else AttemptState.LAUNCHING
        # Whether its ranks belong to the fault schedule: a cold attempt's from its launch, a
        # standby's only from `go` (one let go without it never does, even while ENDING).
        self.faults_see = not standby
        self.running: Running | None = None
        self.launch_error: str | None = None
        self.on_step: Callable[[int], None] | None = None  # told its newest step, once stepped
        self.nodes = list(job.resolved.pool.active)  # where its ranks run, in rank order
        self.stack_places: dict[int, str] = {}  # rank -> its main thread's innermost frame
        self.stragglers = StragglerWatch(
            self.cfg,
            self.table.world,
            self.nodes,
            lambda: len(job.resolved.pool.spares),
            self.emit,
            job.restarts_left,
            job.starting,
        )
        self.replaced: StragglerFinding | None = None  # stopped for this straggler
        self.adopt = adopt  # prepared ranks to start as this attempt's, not a launch

    @property
    def ready_at(self) -> float | None:
        """When every rank of a standby said it waits (monotonic), or None."""
        return self.watch.ready_at

    def emit(self, event: str, **facts: Any) -> None:
        self.job.emit(event, attempt=self.number, **facts)

    def _now_running(self) -> None:
        self.state = AttemptState.RUNNING
        self.faults_see = True
        self.job.faults.attempt_started(self.number)  # it may be hit from now on

    # --- the attempt, start to end ------------------------------------------------------------
    async def start(self) -> bool:
        """Launch the ranks (or start prepared ones as them); False (and `launch_error`) when
        they cannot be started."""
        if self.adopt is not None:
            return await self._become(self.adopt)
        plan = self._plan()
        output, cwd = self.dir / "output.log", self.cfg.launch.cwd or None
        try:
            running = await self.job.launcher.start(
                plan, output, cwd, self.watch.exits.launcher_saw_exit
            )
        except OSError as exc:
            self.launch_error = str(exc)
            standby = self.state is AttemptState.STANDBY
            self.state = AttemptState.ENDING
            self.emit("launch_failed", error=str(exc), standby=standby)
            return False
        self._launched(running)
        return True

    async def run(self, stop: StopRequests) -> AttemptResult:
        if self.state is AttemptState.LAUNCHING:
            await self.start()
        running = self.running
        if running is None:
            err = self.launch_error
            return self._result(Outcome("failure", f"cannot start: {err}"), None, err)
        try:
            end = await self._first_end(running, stop)
            result = await teardown.tear_down(
                running,
                end,
                grace=teardown.grace_for(end, self.cfg.restart.teardown_grace_s),
                rank_pids=self.watch.exits.pids,
                drain=self.job.drain,
                emit=self.emit,
                table=self.table,
            )
        except BaseException:  # the supervisor failed mid-attempt: leave nothing behind
            await running.teardown(ABORT_GRACE_S, self.watch.exits.pids())
            raise
        t = self.table
        outcome = end_outcome(end, t)
        failed = outcome.kind in exits.FAILED
        if failed:
            await running.output_read(OUTPUT_READ_S)  # their last words, before showing them
            attempt_events.show_tail(self.job.console, self.number, running.tail)
        if result.survivors:
            self.emit("teardown_survivors", pids=result.survivors)
        error = error_lines.error_of(t.errors, list(running.tail))
        outcome = exits.said_why(outcome, error)
        blamed = failed and outcome.kind != "diverged"  # the settings' doing, no node's
        blame = self._attribute(end.finding, list(running.tail)) if blamed else None
        return self._result(
            outcome, end.finding, error if outcome.kind != "success" else None, blame
        )

    def _attribute(self, finding: Finding | None, tail: list[str]) -> nodes.Attribution:
        """The node this failure is laid on, from what the attempt saw."""
        return attribution.attribute(
            self.table,
            finding,
            error_at=self.watch.error_at,
            stack_places=self.stack_places,
            tail=tail,
            injected=self.job.faults.ranks_faulted(self.number),
            active=self.nodes,
            ranks_per_node=self.cfg.launch.ranks_per_node,
        )

    def _plan(self) -> LaunchPlan:
        """The attempt's command, with the contract environment (command.txt shows it)."""
        with contextlib.suppress(OSError):  # unwritable: said when command.txt is not written
            self.dir.mkdir(parents=True, exist_ok=True)
        standby = self.state is AttemptState.STANDBY
        resolved = self.job.resolved
        env = self.job.rank_env(self.number, self.dir, standby)
        plan = resolved.plan(env, resolved.kind.master_port())
        try:
            (self.dir / "command.txt").write_text(plan.text())
        except OSError as exc:  # a full run dir: the attempt runs all the same
            self.emit("run_dir_unwritable", path=str(self.dir), error=exc.strerror or str(exc))
        self.table.launched_at = time.monotonic()
        return plan

    async def _become(self, adopt: Adopted) -> bool:
        """Prepared ranks become its ranks; else (one not told) it ends unlaunched: False."""
        self.table.hello_s = prepared.HELLO_S
        why = await prepared.become(adopt, self.job, self.number, self.dir, self.emit)
        if why is not None:
            self.launch_error, self.state = why, AttemptState.ENDING
            return False
        self._launched(adopt.group, prepared=adopt.number)
        return True

    def _launched(self, running: Running, **prepared_from: int) -> None:
        self.running, self.table.launched_at = running, running.started
        standby = self.state is AttemptState.STANDBY
        self.emit(
            "standby_launch" if standby else "launch",
            pids=running.pids,
            world=running.plan.world,
            nodes=running.plan.nodes,
            command=str(self.dir / "command.txt"),
            mono=round(running.started, 6),
            **prepared_from,
        )
        if not standby:
            self._now_running()

    # --- a standby: waiting, go, exit -----------------------------------------------------------
    async def wait_as_standby(self) -> str:
        """Watch a started standby until it is lost; return why. Sets `ready_at` (and emits
        `standby_ready`) once every rank waits. Cancelled when the standby is taken."""
        assert self.running is not None and self.state is AttemptState.STANDBY
        return await self.watch.until_lost(self.running)

    def go(self) -> str | None:
        """Make the standby the running attempt: `go` to every rank. None when every command
        was sent, else why not (then the standby is of no use: tear it down)."""
        control, ready_at = self.job.control, self.ready_at
        assert self.state is AttemptState.STANDBY
        assert control is not None and ready_at is not None
        t = time.time()
        for rank in range(self.table.world):
            err = control.command(self.number, rank, "go", t)
            if err is not None:
                return f"rank {rank}: {err}"
        now = time.monotonic()
        for st in self.table.ranks.values():
            st.last_progress = now  # the load timeout runs from here
        self.emit("standby_go", waited_s=round(now - ready_at, 6))
        self._now_running()
        return None

    async def end_standby(self, reason: str, stopped: bool = False) -> TeardownResult | None:
        """A ready standby: `exit` to every rank, a short wait for them to go, then the teardown
        of whatever is left. One still starting, or whose ranks were stopped (`stopped`), is
        torn down at once, without a grace: its ranks could take neither the command nor
        SIGTERM (a job that has decided to end would wait for them), and a standby holds
        nothing worth saving."""
        running, control = self.running, self.job.control
        if running is None:
            return None
        self.state = AttemptState.ENDING
        grace = 0.0
        if self.ready_at is not None and control is not None and not stopped:
            grace = self.cfg.restart.teardown_grace_s
            t = time.time()
            for rank in range(self.table.world):
                control.command(self.number, rank, "exit", t)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(running.wait(), grace)
        result, _ = await teardown.end_processes(running, grace, self.watch.exits.pids)
        self.watch.exits.close()
        self.emit(
            "standby_exit",
            reason=reason,
            seconds=round(result.seconds, 6),
            killed=result.killed,
            survivors=len(result.survivors),
        )
        return result

    # --- the end: what ended the watch, and the result ------------------------------------------
    async def _first_end(self, running: Running, stop: StopRequests) -> WatchEnd:
        """Wait for the first of: the launcher's exit, a finding of the watch, a stop request."""
        exit_task = asyncio.create_task(running.wait())
        watch_task = asyncio.create_task(self.watch.until_finding(running, self._quiet_check))
        stop_task = asyncio.create_task(stop.more_than(0))
        replace_task = asyncio.create_task(self.stragglers.replace_due.wait())
        try:
            done, _ = await asyncio.wait(
                {exit_task, watch_task, stop_task, replace_task},
                return_when=asyncio.FIRST_COMPLETED,
            )
            self.state = AttemptState.ENDING
            self.job.faults.attempt_over()  # nothing more into an attempt that is ending
            if exit_task in done:
                return WatchEnd("exit", exit_task, exit=exit_task.result())
            if watch_task in done:
                finding, detected = watch_task.result()
                self.job.fence(self.number, finding.kind)  # nothing its ranks write now is used
                if finding.kind in ("hang", "no_progress"):
                    await self._found(finding, detected)
                return await self._judged(finding, exit_task)
            if replace_task in done and not stop.count:  # the straggler's node is to go
                self.replaced = self.stragglers.replacing
            why = "straggler" if self.replaced else None
            grace_end = await teardown.forward_stop(
                running, exit_task, stop, self.cfg.restart.stop_grace_s, self.emit, self.table, why
            )
            return WatchEnd("stop", exit_task, exit=grace_end, stopping=True)
        finally:
            watch_task.cancel()
            stop_task.cancel()
            replace_task.cancel()

    def _quiet_check(self, now: float) -> None:
        """A check that found nothing: the faults' time triggers, the stragglers' replacement."""
        self.job.faults.fire_due(self.table, now)
        self.stragglers.check(self.table.ckpt_complete)

    async def _judged(self, finding: Finding, exit_task: asyncio.Task) -> WatchEnd:
        """A finding ended the watch; for a rank gone, the launcher usually follows at once, and
        its exit status says more: prefer it, unless a rank already said it refused its input."""
        if finding.kind == "rank_exit" and ("usage" not in self.table.causes or self.table.stepped):
            follow = exit_follow_s(finding, self.table.stepped, self.watch.error_at)
            with contextlib.suppress(TimeoutError):
                info = await asyncio.wait_for(asyncio.shield(exit_task), follow)
                return WatchEnd("exit", exit_task, exit=info)
        return WatchEnd(finding.kind, exit_task, finding=finding)

    async def _found(self, finding: Finding, detected: float) -> None:
        """A hang or no progress: every rank's stacks before the teardown, then the finding's
        event, which names them."""
        ask = finding_stacks.remote_asker(self.job.control, self.job.job_id, self.number)
        got = await finding_stacks.collect(
            self.dir, self.table, finding.ranks, this_host=hosts.this_host(), ask_remote=ask
        )
        self.stack_places = got.places
        self.emit(finding.kind, **attempt_events.finding_fields(finding, detected, **got.facts))

    def _result(
        self,
        outcome: Outcome,
        finding: Finding | None,
        error: str | None = None,
        blame: nodes.Attribution | None = None,
    ) -> AttemptResult:
        self.watch.exits.close()
        t = self.table
        record = AttemptRecord(
            self.number, t.effective_resume_step(), t.max_step, outcome.kind, error, t.saved_step
        )
        fields = attempt_events.end_fields(outcome, finding, record, t, error, blame)
        self.emit("attempt_end", **fields)
        replace = self.replaced if outcome.kind == "stopped" else None
        return AttemptResult(self.number, outcome, finding, record, blame, replace)

    # --- what the ranks report ------------------------------------------------------------------
    def on_message(self, msg: dict[str, Any], now: float) -> None:
        """A verified rank message of this attempt (faults see it once the attempt runs)."""
        self.watch.on_message(msg, now)
        if self.on_step is not None and self.table.max_step is not None:
            self.on_step(self.table.max_step)
        if self.state is AttemptState.RUNNING and msg["attempt"] == self.number:
            self.stragglers.on_message(msg)
        if self.faults_see:
            self.job.faults.on_message(msg, self.table, now)  # step, save and checkpoint triggers


def end_outcome(end: WatchEnd, t: AttemptTable) -> Outcome:
    """What the watch's end and the ranks' words make of the attempt (exits.attempt_outcome)."""
    rc = end.exit.returncode if end.exit else None
    done, stepping = bool(t.done_ranks), end.stopping
    return exits.attempt_outcome(
        end.finding, rc, done=done, stopping=stepping, stepped=t.stepped,
        diverged=t.causes.get("diverged"), refused=t.causes.get("usage"),
        said_hello=any(st.pid for st in t.ranks.values()),  # a hello gives a rank its pid
    )  # fmt: skip


def exit_follow_s(finding: Finding, stepped: bool, said: Mapping[int, object]) -> float:
    """How long to wait for the launcher's exit after a rank's process ended: longer when that
    rank said why before any step (EXIT_FOLLOW_SAID_S)."""
    early = not stepped and any(r in said for r in finding.ranks)
    return EXIT_FOLLOW_SAID_S if early else EXIT_FOLLOW_S

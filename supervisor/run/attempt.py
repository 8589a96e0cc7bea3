"""One attempt: start its ranks, watch them (or stop them), tear down, classify.

An attempt owns what lives and dies with one launch: its rank table, its processes, its watch
loop, its events. It returns what happened (`AttemptResult`); what to do next is the job's. Two
attempts may be alive at once (a warm standby beside the running one), so an attempt shares
nothing with another but what `Shared` hands it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from contracts import control_msgs, env_names, stack_files
from supervisor.host import hygiene
from supervisor.launch import launcher
from supervisor.launch.launcher import Exit, LaunchPlan, TeardownResult
from supervisor.launch.resolve import Resolved
from supervisor.policy import decisions, nodes
from supervisor.policy.decisions import AttemptRecord, Finding, Outcome
from supervisor.run.fault_hooks import FaultHooks
from supervisor.run.stop import StopRequests
from supervisor.watch import relays, stacks
from supervisor.watch.control import ControlServer
from supervisor.watch.heartbeat import AttemptTable
from supervisor.watch.pidwatch import ExitWatch
from supervisor.watch.stack_text import summary_lines, where

PROGRESS_EVERY_S = 5.0  # a `progress` event at most this often
REFRESH_TREE_S = 2.0  # how often the attempt's process tree is re-read (for teardown)
TAIL_LINES = 15  # rank output shown when an attempt fails
EXIT_FOLLOW_S = 0.1  # after a rank's process ended, how long to wait for the launcher's exit
ABORT_GRACE_S = 0.5  # teardown grace when the supervisor itself fails mid-attempt
OUTPUT_READ_S = 1.0  # after teardown, how long to wait for the ranks' last output lines
STACKS_SLACK_S = 2.0  # beyond stacks.TOTAL_S: the collection itself is late (a loaded host)


class Running(Protocol):
    """A started attempt's processes as an attempt uses them (`launcher.Launched` is one)."""

    plan: LaunchPlan
    started: float  # monotonic
    tail: Sequence[str]  # the newest lines of the ranks' output

    @property
    def pids(self) -> list[int]: ...

    async def wait(self) -> Exit:
        """The first failing exit, or 0 once every process ended cleanly."""
        ...

    def refresh(self, extra: list[int] = ...) -> None: ...

    def signal_stop(self) -> None:
        """Ask the ranks to save and exit."""
        ...

    async def teardown(self, grace: float, extra: list[int] = ...) -> TeardownResult: ...

    async def output_read(self, timeout: float) -> None:
        """Until what the ended processes wrote has all been read (or `timeout`)."""
        ...


class Launcher(Protocol):
    """Starts attempts (`launcher.ProcessLauncher`; a fake in the job loop's unit tests)."""

    def prepare(self) -> None: ...

    async def start(
        self,
        plan: LaunchPlan,
        output: Path,
        cwd: str | None,
        on_rank_exit: Callable[[int, int], None],
    ) -> Running: ...


@dataclass(frozen=True)
class Shared:
    """What every attempt of one job uses: the job as resolved, its identity, its services."""

    r: Resolved
    job_id: str
    key: str
    heartbeat_address: str
    launcher: Launcher
    faults: FaultHooks
    emit: Callable[..., None]
    drain: Callable[[], object]  # hand the rank messages waiting now to their attempts
    console: IO[str] | None
    control: ControlServer | None = None  # signed commands to ranks (faults, standby go/exit)


@dataclass(frozen=True)
class AttemptResult:
    """What one attempt came to: its outcome, the finding that ended it (if one did), and its
    record for the job's history."""

    number: int
    outcome: Outcome
    finding: Finding | None
    record: AttemptRecord
    attribution: nodes.Attribution | None = None  # the node a failure is laid on, if any


@dataclass
class _End:
    """How the watch ended, before teardown: `reason` is exit, stop or the finding's kind."""

    reason: str
    exit_task: asyncio.Task
    exit: Exit | None = None
    finding: Finding | None = None
    stopping: bool = False


class Attempt:
    """One launch of the job's ranks, run once: `await Attempt(n, shared).run(stop)`.

    A standby (`standby=True`) is started early (`start`), waits prepared (`wait_as_standby`)
    and becomes the running attempt on `go`; `run` then watches it like any other."""

    def __init__(self, number: int, shared: Shared, standby: bool = False) -> None:
        self.number = number
        self.s = shared
        self.cfg = shared.r.cfg
        self.dir = shared.r.run_dir / "attempts" / f"{number:03d}"
        self.table = AttemptTable(number, shared.r.world, time.monotonic(), self.cfg.heartbeat)
        self._last_progress_event = 0.0
        self.standby = standby  # until `go`: faults, progress limits and the job leave it be
        self.running: Running | None = None
        self.launch_error: str | None = None
        self.ready_at: float | None = None  # monotonic: every standby rank said it waits
        self.on_stepped: Callable[[], None] | None = None  # called at the attempt's first step
        self.prepared = ""  # what a standby holds ready, as its rank 0 says it
        self.nodes = list(shared.r.pool.active)  # where its ranks run, in rank order
        self.stack_places: dict[int, str] = {}  # rank -> its main thread's innermost frame
        self.error_at: dict[int, float] = {}  # rank -> when its error message came (monotonic)
        self.exits = ExitWatch(self._pid_ended)  # when this host's ranks end, to the millisecond

    def emit(self, event: str, **facts: Any) -> None:
        self.s.emit(event, attempt=self.number, **facts)

    # --- the attempt, start to end ------------------------------------------------------------
    async def start(self) -> bool:
        """Launch the ranks; False (and `launch_error`) when they cannot be started."""
        plan = self._plan()
        try:
            running = await self.s.launcher.start(
                plan, self.dir / "output.log", self.cfg.launch.cwd or None, self._on_rank_exit
            )
        except OSError as exc:
            self.launch_error = str(exc)
            self.emit("launch_failed", error=str(exc), standby=self.standby)
            return False
        self.running = running
        self._launched(running)
        return True

    async def run(self, stop: StopRequests) -> AttemptResult:
        if self.running is None and self.launch_error is None:
            await self.start()
        running = self.running
        if running is None:
            err = self.launch_error
            return self._result(Outcome("failure", f"cannot start: {err}"), None, err)
        try:
            end = await self._first_end(running, stop)
            teardown = await self._teardown(running, end)
        except BaseException:  # the supervisor failed mid-attempt: leave nothing behind
            await running.teardown(ABORT_GRACE_S, self._rank_pids())
            raise
        t = self.table
        rc = end.exit.returncode if end.exit else None
        outcome = decisions.attempt_outcome(
            end.finding, rc, done=bool(t.done_ranks), stopping=end.stopping, stepped=t.stepped
        )
        if outcome.kind in ("failure", "bad_input"):
            await running.output_read(OUTPUT_READ_S)  # their last words, before showing them
            self._show_tail(running)
        if teardown.survivors:
            self.emit("teardown_survivors", pids=teardown.survivors)
        error = decisions.error_of(t.errors, list(running.tail))
        failed = outcome.kind in ("failure", "bad_input")
        blame = self._attribute(end, list(running.tail)) if failed else None
        return self._result(
            outcome, end.finding, error if outcome.kind != "success" else None, blame
        )

    def _attribute(self, end: _End, tail: list[str]) -> nodes.Attribution:
        """The node this failure is laid on, from what the attempt saw (`nodes.attribute`)."""
        t, finding = self.table, end.finding
        pids = {r: st.pid for r, st in t.ranks.items()}
        stalled = ()
        if finding is not None and finding.kind == "no_progress":
            places = {r: w for r, w in self.stack_places.items() if r in finding.ranks}
            stalled = nodes.outside_collectives(places)
        gone = {r: st.exited_at for r, st in t.ranks.items() if st.exited}
        first_gone = min(gone.values(), default=float("inf"))
        facts = nodes.FailureFacts(
            kind=finding.kind if finding else "exit",
            finding_ranks=finding.ranks if finding else (),
            finding_node=finding.node if finding else None,
            error_ranks=nodes.own_errors(t.errors, self.error_at, first_gone),
            first_exited=nodes.first_exited(gone),
            launcher_named=nodes.launcher_named_ranks(tail, pids),
            injected=self.s.faults.hit(self.number),
            stalled_outside_collectives=stalled,
        )
        return nodes.attribute(facts, self.nodes, self.cfg.launch.ranks_per_node)

    def _plan(self) -> LaunchPlan:
        """The attempt's command, with the contract environment (command.txt shows it)."""
        cfg = self.cfg
        with contextlib.suppress(OSError):  # unwritable: said when command.txt is not written
            self.dir.mkdir(parents=True, exist_ok=True)
        env = {
            **cfg.launch.env,
            env_names.ENV_JOB_ID: self.s.job_id,
            env_names.ENV_ATTEMPT: str(self.number),
            env_names.ENV_HEARTBEAT_ADDR: self.s.heartbeat_address,
            env_names.ENV_HEARTBEAT_KEY: self.s.key,
            env_names.ENV_ATTEMPT_DIR: str(self.dir),
            env_names.ENV_HEARTBEAT_INTERVAL: repr(cfg.heartbeat.interval_s),
            env_names.ENV_EXIT_WITH_PARENT: "1",
        }
        if self.s.control is not None:
            env[env_names.ENV_CONTROL_ADDR] = self.s.control.address
        if self.standby:
            env[env_names.ENV_STANDBY] = "1"
        if relays.relay_wanted(cfg.heartbeat.relay, self.s.r.world, cfg.launch.ranks_per_node):
            env[env_names.ENV_HEARTBEAT_RELAY] = "1"
        plan = self.s.r.plan(env, launcher.free_port() if cfg.launch.launcher == "local" else 0)
        try:
            (self.dir / "command.txt").write_text(plan.text())
        except OSError as exc:  # a full run dir: the attempt runs all the same
            self.emit("run_dir_unwritable", path=str(self.dir), error=exc.strerror or str(exc))
        self.table.launched_at = time.monotonic()
        return plan

    def _launched(self, running: Running) -> None:
        self.table.launched_at = running.started
        self.emit(
            "standby_launch" if self.standby else "launch",
            pids=running.pids,
            world=running.plan.world,
            nodes=running.plan.nodes,
            command=str(self.dir / "command.txt"),
            mono=round(running.started, 6),
        )
        if not self.standby:
            self.s.faults.attempt_started(self.number)  # it may be hit from now on

    # --- a standby: waiting, go, exit -----------------------------------------------------------
    async def wait_as_standby(self) -> str:
        """Watch a started standby until it is lost; return why. Sets `ready_at` (and emits
        `standby_ready`) once every rank waits. Cancelled when the standby is taken."""
        assert self.running is not None
        running, hb, table = self.running, self.cfg.heartbeat, self.table
        exit_task = asyncio.create_task(running.wait())
        period = decisions.judge_period(table.world, hb.check_s)
        last_refresh = 0.0
        try:
            while True:
                await asyncio.wait({exit_task}, timeout=period)
                if exit_task.done():
                    rc = exit_task.result().returncode
                    return f"its ranks exited ({decisions.describe_returncode(rc)})"
                now = time.monotonic()
                self._check_local_pids(now)
                finding = table.judge(now, hb, waiting=True)
                if finding is not None:
                    return f"{finding.kind}: {finding.reason}"
                if self.ready_at is None and decisions.standby_ready(table.ranks, table.world):
                    self.ready_at = now
                    self.emit(
                        "standby_ready",
                        seconds=round(now - table.launched_at, 6),
                        prepared=self.prepared,
                    )
                if now - last_refresh > REFRESH_TREE_S:
                    last_refresh = now
                    running.refresh(self._rank_pids())
        finally:
            exit_task.cancel()

    def go(self) -> str | None:
        """Make the standby the running attempt: `go` to every rank. None when every command
        was sent, else why not (then the standby is of no use: tear it down)."""
        assert self.s.control is not None and self.ready_at is not None
        t = time.time()
        for rank in range(self.table.world):
            err = self.s.control.command(self.number, rank, "go", t)
            if err is not None:
                return f"rank {rank}: {err}"
        now = time.monotonic()
        self.standby = False
        for st in self.table.ranks.values():
            st.last_progress = now  # the load timeout runs from here
        self.emit("standby_go", waited_s=round(now - self.ready_at, 6))
        self.s.faults.attempt_started(self.number)  # it may be hit from now on
        return None

    async def end_standby(self, reason: str) -> TeardownResult | None:
        """A ready standby: `exit` to every rank, a short wait for them to go, then the teardown
        of whatever is left. One still starting is torn down at once, without a grace: its
        ranks could take neither the command nor SIGTERM before they were done starting
        (seconds, and a job that has decided to end would wait for them), and a standby holds
        nothing worth saving."""
        running = self.running
        if running is None:
            return None
        grace = 0.0
        if self.ready_at is not None and self.s.control is not None:
            grace = self.cfg.restart.teardown_grace_s
            t = time.time()
            for rank in range(self.table.world):
                self.s.control.command(self.number, rank, "exit", t)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(running.wait(), grace)
        result, _ = await self._end_processes(running, grace)
        self.exits.close()
        self.emit(
            "standby_exit",
            reason=reason,
            seconds=round(result.seconds, 6),
            killed=result.killed,
            survivors=len(result.survivors),
        )
        return result

    async def _first_end(self, running: Running, stop: StopRequests) -> _End:
        """Wait for the first of: the launcher's exit, a finding of the watch, a stop request."""
        exit_task = asyncio.create_task(running.wait())
        watch_task = asyncio.create_task(self._watch(running))
        stop_task = asyncio.create_task(stop.beyond(0))
        try:
            done, _ = await asyncio.wait(
                {exit_task, watch_task, stop_task}, return_when=asyncio.FIRST_COMPLETED
            )
            self.s.faults.attempt_over()  # nothing more into an attempt that is ending
            if exit_task in done:
                return _End("exit", exit_task, exit=exit_task.result())
            if watch_task in done:
                finding, detected = watch_task.result()
                if finding.kind in ("hang", "no_progress"):
                    await self._found(finding, detected)
                return await self._judged(finding, exit_task)
            grace_end = await self._graceful_stop(running, exit_task, stop)
            return _End("stop", exit_task, exit=grace_end, stopping=True)
        finally:
            watch_task.cancel()
            stop_task.cancel()

    async def _judged(self, finding: Finding, exit_task: asyncio.Task) -> _End:
        """A finding ended the watch; for a rank gone, the launcher usually follows at once, and
        its exit status says more: prefer it."""
        if finding.kind == "rank_exit":
            with contextlib.suppress(TimeoutError):
                info = await asyncio.wait_for(asyncio.shield(exit_task), EXIT_FOLLOW_S)
                return _End("exit", exit_task, exit=info)
        return _End(finding.kind, exit_task, finding=finding)

    async def _graceful_stop(
        self, running: Running, exit_task: asyncio.Task, stop: StopRequests
    ) -> Exit | None:
        """Forward the user's stop; wait for the ranks to save and exit (or a second request)."""
        grace = self.cfg.restart.stop_grace_s
        self.emit("stop", signal=running.plan.stop_signal.name, grace_s=grace)
        running.signal_stop()
        second = asyncio.create_task(stop.beyond(1))
        done, _ = await asyncio.wait(
            {exit_task, second}, timeout=grace, return_when=asyncio.FIRST_COMPLETED
        )
        second.cancel()
        if exit_task in done:
            info = exit_task.result()
            self._emit_exit(info, stopped=True)
            return info
        return None

    async def _teardown(self, running: Running, end: _End) -> TeardownResult:
        """What the ranks said last and the launcher's exit first, then end every process of
        the attempt (and collect the exit status if it came meanwhile)."""
        self.s.drain()  # what the ranks said just before they ended
        t_detect = time.monotonic()
        if end.exit is not None and not end.stopping:
            self._emit_exit(end.exit)
        start = time.monotonic()
        since = end.exit.mono if end.exit else t_detect
        self.emit(
            "teardown",
            reason=end.reason,
            start_mono=round(start, 6),
            latency_s=round(start - since, 6),
        )
        result, segments = await self._end_processes(running)
        self.emit(
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

    async def _end_processes(
        self, running: Running, grace: float | None = None
    ) -> tuple[TeardownResult, list[str]]:
        """The launcher's teardown (`grace`: the config's by default), then the MPICH segments
        its ranks still mapped (killed before every rank was past MPI_Init, they never unlinked
        them): removed here, where they arose, once no process holds them."""
        segments = hygiene.mapped_segments(self._rank_pids())
        if grace is None:
            grace = self.cfg.restart.teardown_grace_s
        result = await running.teardown(grace, self._rank_pids())
        return result, hygiene.remove_unheld(segments) if segments else []

    def _result(
        self,
        outcome: Outcome,
        finding: Finding | None,
        error: str | None = None,
        blame: nodes.Attribution | None = None,
    ) -> AttemptResult:
        self.exits.close()
        t = self.table
        record = AttemptRecord(
            self.number, t.effective_resume_step(), t.max_step, outcome.kind, error, t.saved_step
        )
        mem = t.mem_complete
        detected_by = finding.kind if finding else ("stop" if outcome.kind == "stopped" else "exit")
        self.emit(
            "attempt_end",
            outcome=outcome.kind,
            detail=outcome.detail,
            detected_by=detected_by,
            resume_step=record.resume_step,
            **({"resume_source": t.resume_source} if t.resume_source else {}),
            max_step=record.max_step,
            ckpt_complete=t.ckpt_complete,
            **({"mem_complete": mem} if mem is not None else {}),
            stale_messages=t.stale,
            error=error,
            **({"node": blame.node, "attributed": blame.as_dict()} if blame else {}),
        )
        return AttemptResult(self.number, outcome, finding, record, blame)

    # --- watching -----------------------------------------------------------------------------
    async def _watch(self, running: Running) -> tuple[Finding, float]:
        """Judge liveness and progress every check_s; return the first finding and when it was
        made. A rank gone is said at once; a hang or no progress once the stacks are in."""
        hb, table = self.cfg.heartbeat, self.table
        period = decisions.judge_period(table.world, hb.check_s)
        last_refresh = 0.0
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            self._check_local_pids(now)
            finding = table.judge(now, hb, limits=table.limits)
            period = decisions.judge_period(table.judged, hb.check_s)  # relays: nodes, not ranks
            if finding is not None:
                if finding.kind == "rank_exit":
                    self._emit_finding(finding, now)
                return finding, now
            self.s.faults.poke(table, now)  # time triggers (and anything else now due)
            if now - last_refresh > REFRESH_TREE_S:
                last_refresh = now
                running.refresh(self._rank_pids())
            self._maybe_progress(now)

    def _emit_finding(self, finding: Finding, detected: float, **extra: Any) -> None:
        self.emit(
            finding.kind,
            ranks=list(finding.ranks),
            reason=finding.reason,
            phase=finding.phase,
            step=finding.step,
            deadline_mono=round(finding.deadline, 6),
            detected_mono=round(detected, 6),
            latency_s=round(detected - finding.deadline, 6),
            **({"node": finding.node} if finding.node else {}),
            **extra,
        )

    async def _found(self, finding: Finding, detected: float) -> None:
        """A hang or no progress: every rank's stacks before the teardown (bounded; whatever
        happens there, the teardown follows), then the finding's event, which names them."""
        directory = self.dir / stack_files.STACKS_DIR
        try:
            got = await asyncio.wait_for(
                stacks.collect(
                    self.dir,
                    self.table.ranks,
                    self.table.world,
                    this_host=launcher.this_host(),
                    ask_remote=self._ask_for_stacks if self.s.control is not None else None,
                ),
                stacks.TOTAL_S + STACKS_SLACK_S,
            )
        except Exception as exc:  # a bug or a broken run dir must not keep the ranks alive
            facts: dict[str, Any] = {
                "stacks_dir": str(directory),
                "stacks_error": f"{type(exc).__name__}: {exc}",
            }
        else:
            self.stack_places = {
                st.rank: where(st.place.innermost) for st in got.stacks if st.place is not None
            }
            facts = {
                "stacks_dir": str(got.directory),
                "stacks": summary_lines(got.stacks, finding.ranks),
                "stacks_missing": got.missing,
                "stacks_s": round(got.seconds, 3),
            }
        self._emit_finding(finding, detected, **facts)

    def _ask_for_stacks(self, rank: int) -> str | None:
        """A rank on another host: it signals itself (the control channel's `signal`)."""
        assert self.s.control is not None
        message = control_msgs.control_message(
            self.s.job_id, self.number, rank, time.time(), "signal", 0,
            signal=int(stack_files.STACKS_SIGNAL),
        )  # fmt: skip
        return self.s.control.send(self.number, rank, message)

    def _check_local_pids(self, now: float) -> None:
        """A rank on this host whose process is gone (under mpiexec or srun) is seen at once;
        those with a pidfd (`self.exits`) say so themselves, the moment they end."""
        host = launcher.this_host()
        for st in self.table.on_host(host):
            if st.pid and not st.exited and not self.exits.watching(st.rank):
                try:
                    os.kill(st.pid, 0)
                except ProcessLookupError:
                    self.table.exited(st, now)
                except PermissionError:
                    continue

    def _maybe_progress(self, now: float) -> None:
        t = self.table
        if now - self._last_progress_event >= PROGRESS_EVERY_S and t.max_step is not None:
            self._last_progress_event = now
            self.emit("progress", step=t.max_step, ckpt_complete=t.ckpt_complete)

    def _rank_pids(self) -> list[int]:
        return self.table.local_pids(launcher.this_host())

    # --- what the ranks and the launcher report -----------------------------------------------
    def on_message(self, msg: dict[str, Any], now: float) -> None:
        for note in self.table.update(msg, now):
            self.emit(note.event, **note.fields)
            if note.event == "first_step" and self.on_stepped is not None:
                self.on_stepped()
            elif note.event == "rank_hello" and note.fields["host"] == launcher.this_host():
                self.exits.add(note.fields["rank"], note.fields["pid"])
            elif note.event == "rank_error":
                self.error_at.setdefault(note.fields["rank"], now)
        if msg["kind"] == "phase" and msg["phase"] == "standby" and msg["rank"] == 0:
            prepared = msg.get("prepared")
            if isinstance(prepared, str):
                self.prepared = prepared[:200]
        if not self.standby:
            self.s.faults.on_message(msg, self.table, now)  # step, save and checkpoint triggers

    def _pid_ended(self, rank: int, when: float) -> None:
        """When a local rank's process ended, to the millisecond (the next check judges it, as
        before: the launcher's own exit usually comes first and says more, and a teardown begun
        while the launcher still cleans up cost Hydra's proxies their own clean-up)."""
        st = self.table.ranks.get(rank)
        if st is not None and not st.exited:
            self.table.exited(st, when)

    def _on_rank_exit(self, rank: int, rc: int) -> None:
        now = time.monotonic()
        self.table.exited(self.table.state(rank, now), now)

    def _emit_exit(self, info: Exit, **extra: Any) -> None:
        """The launcher's exit, with what the ranks had said by then."""
        self.emit(
            "exit",
            returncode=info.returncode,
            status=decisions.describe_returncode(info.returncode),
            rank=info.rank,
            exit_mono=round(info.mono, 6),
            step=self.table.max_step,
            said_done=bool(self.table.done_ranks),
            **extra,
        )

    def _show_tail(self, running: Running) -> None:
        out = self.s.console
        lines = list(running.tail)[-TAIL_LINES:]
        if out is None or not lines:
            return
        out.write(f"--- last {len(lines)} lines of attempts/{self.number:03d}/output.log ---\n")
        for line in lines:
            out.write(f"    {line}\n")
        out.flush()

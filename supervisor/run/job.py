"""One job: attempt after attempt until done, out of budget, stuck, or stopped by the user.

The job keeps what outlives an attempt: the heartbeat server, the fault hooks, the history, the
restart budget and backoff, the user's stop requests, and which attempts are alive. Each attempt
runs itself (`attempt.Attempt`); what to do after one is `restarts.decide`; its nodes are the
`NodeKeeper`'s, what it holds on this node the `NodeScratch`'s. Everything the job does is
written to events.jsonl first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
from typing import IO, Any

from contracts.exit_codes import ExitCode
from supervisor.launch.processes import ProcessLauncher
from supervisor.launch.resolve import Resolved
from supervisor.log.events import EventLog
from supervisor.policy import prepared_rules, restarts
from supervisor.policy.restarts import AttemptRecord, Decision
from supervisor.run import fault_hooks, intervals, node_cleaner, services, stragglers
from supervisor.run.attempt import Attempt, AttemptResult
from supervisor.run.context import JobContext, Launcher
from supervisor.run.node_keeper import NodeKeeper
from supervisor.run.node_scratch import NodeScratch
from supervisor.run.prepared import PreparedRanks
from supervisor.run.standby import StandbyKeeper
from supervisor.run.stop import StopRequests, stop_signals
from supervisor.run.templates import Templates
from supervisor.settings import config as config_mod
from supervisor.settings import toml_dump
from supervisor.watch.control import ControlServer, bind_for
from supervisor.watch.rank_table import AttemptTable


def starting_nodes(*keepers: Any) -> set[str]:
    """Where the job's own standby, prepared ranks or fork templates are starting now."""
    return set().union(*(k.starting_nodes() for k in keepers if k is not None))


class Job:
    """Runs a resolved job to its end and returns the supervisor's exit code."""

    def __init__(
        self,
        resolved: Resolved,
        console: IO[str] | None = sys.stderr,
        launcher: Launcher | None = None,
        job_id: str | None = None,
        continued: dict[str, Any] | None = None,
    ) -> None:
        self.resolved = resolved
        self.cfg = resolved.cfg
        self.console = console
        self.launcher: Launcher = launcher or ProcessLauncher()
        # A job continued in its run dir keeps its id: its ranks take up its memory copies.
        self.job_id = job_id or f"{self.cfg.job.name}-{secrets.token_hex(4)}"
        self.continued = continued  # the `continued` event's facts (commands/continuing.py)
        self.key = secrets.token_hex(32)
        self.history: list[AttemptRecord] = []
        self.restarts = 0
        self.stop = StopRequests()
        # Attempts that take rank messages by number: the running one, the standby, and the last
        # one ended until the next starts (its stragglers are counted as stale there).
        self.attempts: dict[int, Attempt] = {}
        self.active: Attempt | None = None
        self.numbers = 0  # the next attempt number (a standby takes one too)
        self.control: ControlServer | None = None
        self.standby: StandbyKeeper | None = None
        self.prepared: PreparedRanks | None = None  # prepared ranks ([restart] warm_spare)
        self.templates: Templates | None = None  # fork templates ([restart] template)
        self.intervals: intervals.IntervalKeeper | None = None  # "auto" checkpoint intervals
        self.events_failing: str | None = None  # why events.jsonl could not be written at the end
        self.scratch = NodeScratch(self.cfg, self.job_id, self.emit)

    # --- the loop ------------------------------------------------------------------------------
    async def run(self) -> ExitCode:
        first_attempt = prepare_run_dir(self.resolved)
        services = self._open()
        first_attempt = max(first_attempt, self.context.first_unfenced())
        code, reason = ExitCode.ERROR, "internal error"
        try:
            self.scratch.open()
            await node_cleaner.clean_nodes(self.resolved, self.job_id, "start", self.emit)
            stop = await self.nodes.check()
            if stop is not None:
                pool = self.resolved.pool.as_dict()
                self.give_up(first_attempt, ExitCode.NODES, stop, nodes=pool)
                code, reason = ExitCode.NODES, stop
            else:
                code, reason = await self._attempts(first_attempt)
        finally:
            await self._close(services, code, reason)
        return code

    def _open(self) -> list[asyncio.Task]:
        """The event log, the heartbeat server, the fault hooks, the node keeper, the signal
        handlers."""
        self.log = EventLog(self.resolved.run_dir / "events.jsonl", self.console)
        self.launcher.prepare()
        self.server = server = services.bind_heartbeat(self.resolved, self.key, self.job_id)
        auto = intervals.auto_tiers(self.cfg)  # checkpoint intervals that tune themselves
        self.standby_off = self.resolved.standby_off  # None: a warm standby is kept
        leased = self.cfg.heartbeat.lease_seconds() > 0  # renewed on the control channel
        if self.standby_off is None or self.cfg.faults or auto or leased:
            self.control = ControlServer(self.key.encode(), self.job_id, *bind_for(server.address))
        if auto is not None and self.control is not None:
            self.intervals = intervals.IntervalKeeper(auto, self.job_id, self.control, self.emit)
        self.faults = fault_hooks.for_job(
            self.cfg, self.resolved.world, self.key, self.job_id, server.address, self.emit,
            self.control, others=self._standby_tables,
        )  # fmt: skip
        self.nodes = NodeKeeper(self.resolved, self.emit, self.faults)
        self.context = JobContext(
            self.resolved, self.job_id, self.key, server.address, self.launcher, self.faults,
            self.emit, lambda: server.drain(self._on_message), self.console, self.control,
            lambda: restarts.restarts_left(self.cfg.restart.max_restarts, self.restarts),
            self.intervals, lambda: starting_nodes(self.standby, self.prepared, self.templates),
        )  # fmt: skip
        if self.standby_off is None:
            self.standby = StandbyKeeper(
                self.context, self._next_number, self._route, self._unroute
            )
        self.prepared_off = prepared_rules.unavailable(
            wanted=self.cfg.restart.warm_spare,
            standby_off=self.standby_off,
            spares=len(self.resolved.pool.spares),
            launcher_cannot=self.resolved.kind.node_launches(self.resolved.flavor),
            module=self.cfg.worker.module,
        )
        if self.prepared_off is None:
            self.prepared = PreparedRanks(self.context, self._next_number, self._standby_ready)
        loop = asyncio.get_running_loop()
        self.stop_signals = stop_signals()  # read before our handlers replace what they were
        for sig in self.stop_signals:
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.emit("start", **start_facts(self.resolved, self.job_id, server.address,
                                         self.continued is not None))  # fmt: skip
        if self.continued is not None:  # what changed since the run it continues
            self.emit("continued", **self.continued)
        if self.cfg.restart.standby and self.standby_off is not None:  # asked for, not declared
            self.emit("standby_off", reason=self.standby_off)
        tasks = [
            asyncio.create_task(server.serve(self._on_message)),
            asyncio.create_task(services.report_dropped(server, self.cfg.heartbeat, self.emit)),
        ]
        if self.control is not None:
            serving = services.serve_control(self.control, self.cfg.heartbeat, self.emit)
            tasks.append(asyncio.create_task(serving))
        return tasks

    async def _close(self, services: list[asyncio.Task], code: ExitCode, reason: str) -> None:
        # Signals that arrive while we finish are noted, not fatal (the ranks are handled).
        loop = asyncio.get_running_loop()
        for sig in self.stop_signals:
            loop.add_signal_handler(sig, self.stop.request)
        self.scratch.close()  # first: whatever fails below, the node's memory is freed
        await node_cleaner.clean_nodes(self.resolved, self.job_id, "end", self.emit)  # others'
        for task in services:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.faults.close()  # a summary event
        if self.control is not None:
            self.control.close()
        self.emit(
            "supervisor_exit",
            code=int(code),
            code_name=code.name,
            reason=reason,
            restarts=self.restarts,
            dropped=dict(self.server.dropped),
        )
        self.server.close()
        self.events_failing = self.log.failing
        self.log.close()

    async def _attempts(self, first: int) -> tuple[ExitCode, str]:
        self.numbers = first
        if self.stop.count:  # asked to stop before anything ran (during the node check, say)
            self.give_up(first, ExitCode.INTERRUPTED, "interrupted before the first launch")
            return ExitCode.INTERRUPTED, "interrupted"
        self.templates = await Templates.start_for(self.context)
        attempt = Attempt(self._next_number(), self.context)
        try:
            return await self._attempts_from(attempt)
        finally:
            if self.standby is not None:  # the job is over, however: no standby outlives it
                await self.standby.close("job over", for_good=True)
            if self.prepared is not None:
                await self.prepared.close("job over")
            if self.templates is not None:
                await self.templates.close()

    async def _attempts_from(self, attempt: Attempt) -> tuple[ExitCode, str]:
        while True:
            number = attempt.number
            result = await self._attempt(attempt)
            self.context.let_go(number, result.outcome.kind)  # its processes are gone
            self.history.append(result.record)
            if self.intervals is not None:  # a failure: the rate the intervals are tuned for
                self.intervals.attempt_ended(result.record)
            if result.replace is not None and not self.stop.count:  # its node out, relaunched
                attempt = await stragglers.replace(result, self)
                if isinstance(attempt, Attempt):
                    continue
                return attempt
            decision = restarts.decide(
                result.outcome,
                self.history,
                self.restarts,
                self.cfg.restart,
                interrupted=self.stop.count > 0,
            )
            if decision.action == "done":
                step = result.record.max_step
                self.emit("done", attempt=number, step=step, restarts=self.restarts)
                return decision.exit_code, decision.reason
            if decision.action == "stop":
                self.give_up(number, decision.exit_code, decision.reason, **decision.facts)
                return decision.exit_code, decision.reason
            stop = self.nodes.count_failure(result.attribution, result.number)
            if stop is None:  # a node known lost, or silent: checked again, out at once
                stop = await self.nodes.recheck(result.number, *silent_node(result))
            if stop is not None:
                self.give_up(number, ExitCode.NODES, stop, nodes=self.resolved.pool.as_dict())
                return ExitCode.NODES, stop
            attempt = await self.relaunch(number, decision)
            if attempt is None:
                self.give_up(number, ExitCode.INTERRUPTED, "interrupted during backoff")
                return ExitCode.INTERRUPTED, "interrupted"

    async def _attempt(self, attempt: Attempt) -> AttemptResult:
        """Run `attempt`; until it ends, the rank messages of its number go to it."""
        previous, self.active = self.active, attempt
        keep = (attempt, previous, self.standby.attempt if self.standby else None)
        self.attempts = {a.number: a for a in keep if a is not None}
        if self.standby is not None:  # a standby once it has stepped (and caught up)
            also = self.prepared.ensure if self.prepared is not None else None
            attempt.on_step = self.standby.starter(previous, also)
        return await attempt.run(self.stop)

    async def relaunch(self, after: int, decision: Decision) -> Attempt | None:
        """Count the restart, take the standby (else a cold attempt), wait the backoff, and
        say go; None if the user asked to stop meanwhile."""
        self.restarts += 1
        left = restarts.restarts_left(self.cfg.restart.max_restarts, self.restarts)
        if self.templates is not None:  # a lost node's template went with it
            await self.templates.drop_down()
        standby, cold_because = None, f"standby off: {self.standby_off}"
        if self.standby is not None:
            standby, cold_because = await self.standby.take(self.nodes.just_excluded)
        adopt, why = None, self.prepared_off
        if standby is None and self.prepared is not None:
            adopt, why = self.prepared.take(self.resolved.active)
        if why is not None and self.nodes.just_excluded:  # a spare's start: warm or why not
            cold_because = f"{cold_because}; no prepared ranks: {why}"
        number = standby.number if standby else self._next_number()
        self.emit(
            "relaunch",
            attempt=number,
            after=after,
            delay_s=decision.delay_s,
            restarts=self.restarts,
            restarts_left=left,
            reason=decision.reason,
            mode="warm" if standby else ("prepared" if adopt else "cold"),
            **({} if standby else {"standby_unused" if adopt else "cold_because": cold_because}),
            **({"standby_waited_s": waited} if (waited := self._standby_waited()) else {}),
        )
        if decision.delay_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.more_than(0), decision.delay_s)
        if self.stop.count:
            if standby is not None:
                await standby.end_standby("interrupted")
            if adopt is not None:
                await adopt.group.teardown(0.0)
            return None
        if standby is None:
            return Attempt(number, self.context, adopt=adopt)
        why = standby.go() if standby.running is not None else "no standby running"
        if why is None:
            return standby
        self.emit("standby_lost", attempt=standby.number, reason=why, was_ready=True)
        await standby.end_standby("go failed")
        return Attempt(self._next_number(), self.context)

    def _standby_waited(self) -> float:
        return self.standby.waited_s if self.standby is not None else 0.0

    def _standby_tables(self) -> list[AttemptTable]:
        tables = self.standby.tables() if self.standby is not None else []
        return tables + (self.prepared.tables() if self.prepared is not None else [])

    def _standby_ready(self) -> bool:
        standby = self.standby.attempt if self.standby is not None else None
        return standby is not None and standby.ready_at is not None

    def _next_number(self) -> int:
        self.numbers += 1
        return self.numbers - 1

    def _route(self, attempt: Attempt) -> None:
        self.attempts[attempt.number] = attempt

    def _unroute(self, attempt: Attempt) -> None:
        if attempt is not self.active:
            self.attempts.pop(attempt.number, None)

    def give_up(self, attempt: int, code: ExitCode, reason: str, **facts: Any) -> None:
        self.emit(
            "give_up",
            attempt=attempt,
            code=int(code),
            code_name=code.name,
            reason=reason,
            restarts=self.restarts,
            **facts,
        )

    # --- services --------------------------------------------------------------------------------
    def emit(self, event: str, **facts: Any) -> None:
        self.log.emit(event, **facts)

    def _on_message(self, msg: dict[str, Any], now: float) -> None:
        """A verified rank message, to its attempt (a straggler: to the running one, as
        stale)."""
        if self.prepared is not None and msg["attempt"] == self.prepared.number:
            self.prepared.on_message(msg, now)
            return
        to = self.attempts.get(msg["attempt"]) or self.active
        if to is not None:
            to.on_message(msg, now)
        if self.intervals is not None:  # rank 0's step times and costs
            self.intervals.on_message(msg)

    def _on_signal(self, sig: signal.Signals) -> None:
        self.stop.request()
        self.emit("signal", signal=signal.Signals(sig).name, count=self.stop.count)


def start_facts(resolved: Resolved, job_id: str, heartbeat: str, continues: bool) -> dict:
    """The `start` event's facts: the job, where it runs, its budget."""
    pool = resolved.pool
    return {
        "job": job_id,
        "pid": os.getpid(),
        "config": resolved.cfg.source,
        "run_dir": str(resolved.run_dir),
        "nodes": resolved.active,
        **({"spares": list(pool.spares)} if pool.spares else {}),
        "world": resolved.world,
        "launcher": resolved.flavor,
        "heartbeat": heartbeat,
        "max_restarts": resolved.cfg.restart.max_restarts,
        "continues": continues,
    }


def silent_node(result: AttemptResult) -> tuple[str | None, str]:
    """The node a hang or a stall is laid on (its ranks went silent), and what was seen; or
    (None, "")."""
    finding, blame = result.finding, result.attribution
    if finding is None or finding.kind not in ("hang", "no_progress") or blame is None:
        return None, ""
    return blame.node, finding.reason


def prepare_run_dir(resolved: Resolved) -> int:
    """The run dir, its resolved config and host file; the first attempt's number."""
    run_dir = resolved.run_dir
    try:
        (run_dir / "attempts").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(toml_dump.dumps(resolved.resolved_dict()))
        resolved.write_hostfile()
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise config_mod.ConfigError(
            str(run_dir), "", f"run dir cannot be written ({why}); free it or choose another"
        ) from None
    existing = [int(p.name) for p in (run_dir / "attempts").iterdir() if p.name.isdigit()]
    return max(existing) + 1 if existing else 0

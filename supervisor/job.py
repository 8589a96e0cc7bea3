"""One job: launch, watch, tear down, decide, relaunch, until done or out of budget.

The loop gathers facts (the launcher's exit, the heartbeat table, the clock, signals to the
supervisor) and hands them to `decisions`; everything it does is written to events.jsonl first.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from supervisor import config as config_mod
from supervisor import decisions, launcher, protocol
from supervisor.config import Config
from supervisor.decisions import AttemptRecord, ExitCode, Finding
from supervisor.events import EventLog
from supervisor.heartbeat import AttemptTable, HeartbeatServer

PROGRESS_EVERY_S = 5.0  # a `progress` event at most this often
REFRESH_TREE_S = 2.0  # how often the attempt's process tree is re-read (for teardown)
TAIL_LINES = 15  # rank output shown when an attempt fails
EXIT_FOLLOW_S = 0.1  # after a rank's process ended, how long to wait for the launcher's exit


@dataclass
class Resolved:
    """What `run` fixes once for the whole job: the same nodes and command on every attempt."""

    cfg: Config
    run_dir: Path
    nodes: list[str]
    executable: str
    flavor: str

    @property
    def world(self) -> int:
        return len(self.nodes) * self.cfg.launch.ranks_per_node

    def hostfile(self) -> Path:
        return self.run_dir / "hostfile"

    def plan(self, env: dict[str, str], master_port: int = 0) -> launcher.LaunchPlan:
        return launcher.build_plan(
            self.cfg,
            self.nodes,
            self.executable,
            self.flavor,
            env,
            self.run_dir,
            self.hostfile(),
            master_port,
        )

    def resolved_dict(self) -> dict[str, Any]:
        d = config_mod.to_dict(self.cfg)
        d["job"]["run_dir"] = str(self.run_dir)
        d["launch"]["nodes"] = list(self.nodes)
        d["launch"]["executable"] = self.executable
        if self.cfg.launch.launcher == "mpiexec":
            d["launch"]["flavor"] = self.flavor
        return d


def resolve(cfg: Config, environ: dict[str, str] | None = None) -> Resolved:
    """Fix run dir, nodes, launcher and its flavor; raise ConfigError / LauncherMissing."""
    environ = dict(os.environ if environ is None else environ)
    run_dir = config_mod.expand_run_dir(cfg)
    flags = cfg.worker.flags
    flags.setdefault("ckpt_dir", str(run_dir / "ckpt"))
    for key, value in flags.items():
        if isinstance(value, str):
            flags[key] = value.replace("{run_dir}", str(run_dir)).replace("{name}", cfg.job.name)
    nodes = launcher.resolve_nodes(cfg.launch, environ, cfg.source)
    executable = launcher.find_executable(cfg)
    flavor = "local"
    if cfg.launch.launcher == "srun":
        flavor = "srun"
    elif cfg.launch.launcher == "mpiexec":
        flavor = cfg.launch.flavor
        if flavor == "auto":
            flavor = launcher.detect_flavor(executable)
            if flavor == "unknown":
                raise config_mod.ConfigError(
                    cfg.source,
                    "launch.flavor",
                    f'cannot tell the flavor of {executable}; set "hydra" or "pals"',
                )
    if cfg.faults:  # faults/: a rank or node beyond the resolved world is a config error too
        from faults.spec import parse_all, shape_of

        parse_all(cfg.faults, cfg.source, shape_of(cfg, len(nodes)))
    return Resolved(cfg, run_dir, nodes, executable, flavor)


class Job:
    """Runs a resolved job to its end and returns the supervisor's exit code."""

    def __init__(self, r: Resolved, console: IO[str] | None = sys.stderr) -> None:
        self.r = r
        self.cfg = r.cfg
        self.console = console
        self.job_id = f"{self.cfg.job.name}-{secrets.token_hex(4)}"
        self.key = secrets.token_hex(32)
        self.log: EventLog | None = None
        self.server: HeartbeatServer | None = None
        self.table: AttemptTable | None = None
        self.launched: launcher.Launched | None = None
        self.history: list[AttemptRecord] = []
        self.restarts = 0
        self.stop_requests = 0
        self._stop_event = asyncio.Event()
        self._last_progress_event = 0.0
        self._last_dropped = 0
        self.faults: Any = None  # faults.engine.FaultEngine when the config declares [[faults]]

    # --- setup ---------------------------------------------------------------------------------
    def _prepare(self) -> int:
        run_dir = self.r.run_dir
        (run_dir / "attempts").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.toml").write_text(config_mod.dumps(self.r.resolved_dict()))
        self.r.hostfile().write_text("".join(f"{n}\n" for n in self.r.nodes))
        existing = [int(p.name) for p in (run_dir / "attempts").iterdir() if p.name.isdigit()]
        return max(existing) + 1 if existing else 0

    def _bind(self) -> HeartbeatServer:
        hb = self.cfg.heartbeat
        local = all(launcher.is_this_host(n) for n in self.r.nodes)
        bind = hb.bind if hb.bind != "auto" else ("127.0.0.1" if local else "0.0.0.0")
        advertise = (
            hb.advertise
            if hb.advertise != "auto"
            else ("127.0.0.1" if local else launcher.this_host())
        )
        return HeartbeatServer(self.key.encode(), self.job_id, bind, hb.port, advertise)

    def emit(self, event: str, **facts: Any) -> None:
        assert self.log is not None
        self.log.emit(event, **facts)

    # --- the loop ------------------------------------------------------------------------------
    async def run(self) -> ExitCode:
        first_attempt = self._prepare()
        self.log = EventLog(self.r.run_dir / "events.jsonl", self.console)
        launcher.become_subreaper()
        self.server = self._bind()
        if self.cfg.faults:  # faults/: the declared schedule, fed by the hooks marked "faults"
            from faults.engine import FaultEngine

            self.faults = FaultEngine.create(
                self.cfg, self.r.world, self.key, self.job_id, self.server.address, self.emit
            )
        serve = asyncio.create_task(self.server.serve(self._on_message))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        self.emit(
            "start",
            job=self.job_id,
            pid=os.getpid(),
            config=self.cfg.source,
            run_dir=str(self.r.run_dir),
            nodes=self.r.nodes,
            world=self.r.world,
            launcher=self.r.flavor,
            heartbeat=self.server.address,
            max_restarts=self.cfg.restart.max_restarts,
        )
        code = ExitCode.ERROR
        reason = "internal error"
        try:
            code, reason = await self._attempts(first_attempt)
        finally:
            # Signals that arrive while we finish are noted, not fatal (the ranks are handled).
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._late_signal, sig)
            serve.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serve
            if self.launched is not None:  # an exception mid-attempt: leave nothing behind
                await self.launched.teardown(0.5, self._rank_pids())
            if self.faults:  # faults: a summary event, the control socket closed
                self.faults.close()
            self.emit(
                "supervisor_exit",
                code=int(code),
                code_name=code.name,
                reason=reason,
                restarts=self.restarts,
                dropped=dict(self.server.dropped),
            )
            self.server.close()
            self.log.close()
        return code

    async def _attempts(self, attempt: int) -> tuple[ExitCode, str]:
        while True:
            outcome, finding = await self._one_attempt(attempt)
            t = self.table
            assert t is not None
            rec = AttemptRecord(attempt, t.effective_resume_step(), t.max_step, outcome.kind)
            self.history.append(rec)
            decision = decisions.decide(
                outcome,
                self.history,
                self.restarts,
                self.cfg.restart,
                interrupted=self.stop_requests > 0,
            )
            self.emit(
                "attempt_end",
                attempt=attempt,
                outcome=outcome.kind,
                detail=outcome.detail,
                detected_by=finding.kind
                if finding
                else ("exit" if outcome.kind != "stopped" else "stop"),
                resume_step=rec.resume_step,
                max_step=rec.max_step,
                ckpt_complete=t.ckpt_complete,
                stale_messages=t.stale,
            )
            if decision.action == "done":
                self.emit("done", attempt=attempt, step=t.max_step, restarts=self.restarts)
                return decision.exit_code, decision.reason
            if decision.action == "stop":
                self.emit(
                    "give_up",
                    attempt=attempt,
                    code=int(decision.exit_code),
                    code_name=decision.exit_code.name,
                    reason=decision.reason,
                    restarts=self.restarts,
                    **decision.facts,
                )
                return decision.exit_code, decision.reason
            self.restarts += 1
            left = decisions.restarts_left(self.cfg.restart.max_restarts, self.restarts)
            self.emit(
                "relaunch",
                attempt=attempt + 1,
                after=attempt,
                delay_s=decision.delay_s,
                restarts=self.restarts,
                restarts_left=left,
                reason=decision.reason,
            )
            if decision.delay_s > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop_event.wait(), decision.delay_s)
            if self.stop_requests:
                self.emit(
                    "give_up",
                    attempt=attempt,
                    code=int(ExitCode.INTERRUPTED),
                    code_name="INTERRUPTED",
                    reason="interrupted during backoff",
                    restarts=self.restarts,
                )
                return ExitCode.INTERRUPTED, "interrupted"
            attempt += 1

    async def _one_attempt(self, attempt: int) -> tuple[decisions.Outcome, Finding | None]:
        cfg, r = self.cfg, self.r
        attempt_dir = r.run_dir / "attempts" / f"{attempt:03d}"
        attempt_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **cfg.launch.env,
            protocol.ENV_JOB_ID: self.job_id,
            protocol.ENV_ATTEMPT: str(attempt),
            protocol.ENV_HEARTBEAT_ADDR: self.server.address,
            protocol.ENV_HEARTBEAT_KEY: self.key,
            protocol.ENV_ATTEMPT_DIR: str(attempt_dir),
            protocol.ENV_HEARTBEAT_INTERVAL: repr(cfg.heartbeat.interval_s),
            protocol.ENV_EXIT_WITH_PARENT: "1",
            **(self.faults.env() if self.faults else {}),  # faults: the control channel
        }
        plan = r.plan(env, launcher.free_port() if cfg.launch.launcher == "local" else 0)
        (attempt_dir / "command.txt").write_text(plan.text())
        self.table = table = AttemptTable(attempt, plan.world, time.monotonic())
        try:
            launched = await launcher.Launched.start(
                plan, attempt_dir / "output.log", cfg.launch.cwd or None, self._on_rank_exit
            )
        except OSError as exc:
            self.emit("launch_failed", attempt=attempt, error=str(exc))
            return decisions.Outcome("failure", f"cannot start: {exc}"), None
        self.launched = launched
        table.launched_at = launched.started
        self.emit(
            "launch",
            attempt=attempt,
            pids=launched.pids,
            world=plan.world,
            nodes=plan.nodes,
            command=str(attempt_dir / "command.txt"),
            mono=round(launched.started, 6),
        )
        if self.faults:  # faults: this attempt may be hit from now on
            self.faults.attempt_started(attempt)

        exit_task = asyncio.create_task(launched.wait())
        watch_task = asyncio.create_task(self._watch(launched, table))
        stop_task = asyncio.create_task(self._stop_event.wait())
        finding: Finding | None = None
        stopping = False
        done, _ = await asyncio.wait(
            {exit_task, watch_task, stop_task}, return_when=asyncio.FIRST_COMPLETED
        )
        if self.faults:  # faults: nothing more into an attempt that is ending
            self.faults.attempt_over()
        teardown_reason = ""
        exit_info: launcher.Exit | None = None
        if exit_task in done:
            exit_info = exit_task.result()
            teardown_reason = "exit"
        elif watch_task in done:
            finding = watch_task.result()
            teardown_reason = finding.kind
            if finding.kind == "rank_exit":
                # The launcher usually follows its rank at once: prefer its exit status.
                with contextlib.suppress(TimeoutError):
                    exit_info = await asyncio.wait_for(asyncio.shield(exit_task), EXIT_FOLLOW_S)
                    finding, teardown_reason = None, "exit"
        else:
            stopping = True
            teardown_reason = "stop"
            exit_info = await self._graceful_stop(launched, exit_task, attempt)
        watch_task.cancel()
        stop_task.cancel()
        self.server.drain(self._on_message)  # what the ranks said just before they ended

        t_detect = time.monotonic()
        if exit_info is not None and not stopping:
            self._emit_exit(attempt, exit_info, table)
        teardown = await self._teardown(
            launched, attempt, teardown_reason, exit_info.mono if exit_info else t_detect
        )
        if exit_info is None and exit_task.done():
            exit_info = exit_task.result()
        if not exit_task.done():
            exit_task.cancel()
        self.launched = None

        if finding is not None:
            outcome = decisions.Outcome("failure", f"{finding.kind}: {finding.reason}")
        else:
            rc = exit_info.returncode if exit_info else -signal.SIGKILL
            outcome = decisions.classify_exit(
                rc, done=bool(table.done_ranks), stopping=stopping, stepped=table.stepped
            )
        if outcome.kind in ("failure", "bad_input"):
            self._show_tail(launched, attempt)
        if teardown.survivors:
            self.emit("teardown_survivors", attempt=attempt, pids=teardown.survivors)
        return outcome, finding

    def _emit_exit(
        self, attempt: int, info: launcher.Exit, table: AttemptTable, **extra: Any
    ) -> None:
        """The launcher's exit, with what the ranks had said by then."""
        self.emit(
            "exit",
            attempt=attempt,
            returncode=info.returncode,
            status=decisions.describe_returncode(info.returncode),
            rank=info.rank,
            exit_mono=round(info.mono, 6),
            step=table.max_step,
            said_done=bool(table.done_ranks),
            **extra,
        )

    async def _graceful_stop(
        self, launched: launcher.Launched, exit_task: asyncio.Task, attempt: int
    ) -> launcher.Exit | None:
        """Forward a graceful stop; wait for the ranks to save and exit (or a second signal)."""
        grace = self.cfg.restart.stop_grace_s
        self.emit("stop", attempt=attempt, signal=launched.plan.stop_signal.name, grace_s=grace)
        launched.signal_stop()
        self._stop_event.clear()
        second = asyncio.create_task(self._stop_event.wait())
        done, _ = await asyncio.wait(
            {exit_task, second}, timeout=grace, return_when=asyncio.FIRST_COMPLETED
        )
        second.cancel()
        if exit_task in done:
            info = exit_task.result()
            self._emit_exit(attempt, info, self.table, stopped=True)
            return info
        return None

    async def _teardown(
        self, launched: launcher.Launched, attempt: int, reason: str, since: float
    ) -> launcher.TeardownResult:
        start = time.monotonic()
        self.emit(
            "teardown",
            attempt=attempt,
            reason=reason,
            start_mono=round(start, 6),
            latency_s=round(start - since, 6),
        )
        result = await launched.teardown(self.cfg.restart.teardown_grace_s, self._rank_pids())
        self.emit(
            "teardown_done",
            attempt=attempt,
            seconds=round(result.seconds, 6),
            terminated=result.terminated,
            killed=result.killed,
            survivors=len(result.survivors),
        )
        return result

    async def _watch(self, launched: launcher.Launched, table: AttemptTable) -> Finding:
        """Judge liveness and progress every check_s; return the first finding."""
        hb = self.cfg.heartbeat
        period = decisions.judge_period(table.world, hb.check_s)
        last_refresh = 0.0
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            self._check_local_pids(table, now)
            finding = decisions.judge_ranks(table.ranks, table.world, now, table.launched_at, hb)
            if finding is not None:
                self.emit(
                    finding.kind,
                    attempt=table.attempt,
                    ranks=list(finding.ranks),
                    reason=finding.reason,
                    phase=finding.phase,
                    step=finding.step,
                    deadline_mono=round(finding.deadline, 6),
                    detected_mono=round(now, 6),
                    latency_s=round(now - finding.deadline, 6),
                )
                return finding
            if self.faults:  # faults: time triggers (and anything else now due)
                self.faults.poke(table, now)
            if now - last_refresh > REFRESH_TREE_S:
                last_refresh = now
                launched.refresh(self._rank_pids())
            self._maybe_progress(table, now)

    def _check_local_pids(self, table: AttemptTable, now: float) -> None:
        """A rank on this host whose process is gone (under mpiexec or srun) is seen at once."""
        host = launcher.this_host()
        for st in table.ranks.values():
            if st.pid and not st.exited and st.host == host:
                try:
                    os.kill(st.pid, 0)
                except ProcessLookupError:
                    st.exited, st.exited_at = True, now
                except PermissionError:
                    continue

    def _maybe_progress(self, table: AttemptTable, now: float) -> None:
        if now - self._last_progress_event >= PROGRESS_EVERY_S and table.max_step is not None:
            self._last_progress_event = now
            self.emit(
                "progress",
                attempt=table.attempt,
                step=table.max_step,
                ckpt_complete=table.ckpt_complete,
            )
        dropped = sum(self.server.dropped.values())
        if dropped != self._last_dropped:
            self._last_dropped = dropped
            self.emit("bad_messages", total=dropped, by_reason=dict(self.server.dropped))

    def _rank_pids(self) -> list[int]:
        t = self.table
        return t.local_pids(launcher.this_host()) if t else []

    # --- callbacks ----------------------------------------------------------------------------
    def _on_message(self, msg: dict[str, Any], now: float) -> None:
        table = self.table
        if table is None:
            return
        for note in table.update(msg, now):
            self.emit(note.event, attempt=table.attempt, **note.fields)
        if self.faults:  # faults: step, save and checkpoint triggers, as the messages arrive
            self.faults.on_message(msg, table, now)

    def _on_rank_exit(self, rank: int, rc: int) -> None:
        table = self.table
        if table is None:
            return
        now = time.monotonic()
        st = table.ranks.get(rank)
        if st is None:
            st = table.ranks[rank] = decisions.RankState(rank, now, now)
        st.exited, st.exited_at = True, now

    def _on_signal(self, sig: signal.Signals) -> None:
        self.stop_requests += 1
        self.emit("signal", signal=signal.Signals(sig).name, count=self.stop_requests)
        self._stop_event.set()

    def _late_signal(self, sig: signal.Signals) -> None:
        self.stop_requests += 1

    def _show_tail(self, launched: launcher.Launched, attempt: int) -> None:
        if self.console is None:
            return
        lines = list(launched.tail)[-TAIL_LINES:]
        if not lines:
            return
        out = self.console
        out.write(f"--- last {len(lines)} lines of attempts/{attempt:03d}/output.log ---\n")
        for line in lines:
            out.write(f"    {line}\n")
        out.flush()

"""An attempt's life (`AttemptState`): which state each step leaves it in, and that a standby's
ranks reach the fault schedule only once it has gone live (never while it waits, nor while a
standby that was never taken is let go)."""

from __future__ import annotations

import asyncio
import socket
import sys
import time

from contracts import messages
from supervisor.launch.processes import TeardownResult
from supervisor.launch.resolve import Resolved
from supervisor.run.attempt import Attempt, AttemptState
from supervisor.run.context import JobContext
from supervisor.settings import loading


class QuietRunning:
    """Started ranks that say nothing and never exit until torn down."""

    def __init__(self, plan) -> None:
        self.plan, self.started, self.tail, self.pids = plan, time.monotonic(), [], []

    async def wait(self):
        await asyncio.Event().wait()

    def refresh(self, extra=()) -> None:
        pass

    def worker_pids(self) -> list[int]:
        return []

    async def teardown(self, grace, extra=()) -> TeardownResult:
        return TeardownResult(0, 0, [], 0.0)


class Launcher:
    def __init__(self, fails: bool = False) -> None:
        self.fails = fails

    def prepare(self) -> None:
        pass

    async def start(self, plan, output, cwd, on_rank_exit):
        if self.fails:
            raise FileNotFoundError("no such launcher")
        return QuietRunning(plan)


class HeardFaults:
    """The fault hooks, recording which attempts' messages reach them."""

    def __init__(self) -> None:
        self.heard: list[int] = []
        self.started: list[int] = []

    def attempt_started(self, attempt: int) -> None:
        self.started.append(attempt)

    def on_message(self, msg, table, now) -> None:
        self.heard.append(msg["attempt"])

    def attempt_over(self) -> None:
        pass


def context(tmp_path, launcher: Launcher) -> JobContext:
    cfg = loading.from_dict({"job": {"name": "state", "run_dir": str(tmp_path / "run")}})
    resolved = Resolved(cfg, tmp_path / "run", [socket.gethostname()], sys.executable, "local")
    return JobContext(
        resolved=resolved,
        job_id="job",
        key="00" * 32,
        heartbeat_address="tcp://127.0.0.1:1",
        launcher=launcher,
        faults=HeardFaults(),
        emit=lambda event, **facts: None,
        drain=lambda: None,
        console=None,
    )


def said(attempt: Attempt, kind: str = "ckpt", **fields) -> None:
    ident = messages.RankIdentity("job", attempt.number, 0, 1, socket.gethostname(), 1)
    fields = fields or {"step": 5, "state": "complete"}
    attempt.on_message(ident.message(kind, time.time(), **fields), time.monotonic())


def test_a_cold_attempt_launches_runs_and_ends(tmp_path):
    async def scenario():
        job = context(tmp_path, Launcher())
        attempt = Attempt(1, job)
        assert attempt.state is AttemptState.LAUNCHING
        assert await attempt.start() and attempt.state is AttemptState.RUNNING
        assert job.faults.started == [1]
        said(attempt)
        return job

    job = asyncio.run(scenario())
    assert job.faults.heard == [1]


def test_a_launch_that_fails_ends_the_attempt(tmp_path):
    async def scenario():
        attempt = Attempt(1, context(tmp_path, Launcher(fails=True)))
        assert not await attempt.start()
        return attempt

    attempt = asyncio.run(scenario())
    assert attempt.state is AttemptState.ENDING and attempt.launch_error == "no such launcher"


def test_a_standby_let_go_never_reaches_the_faults(tmp_path):
    async def scenario():
        job = context(tmp_path, Launcher())
        attempt = Attempt(2, job, standby=True)
        assert await attempt.start() and attempt.state is AttemptState.STANDBY
        said(attempt)  # waiting: the faults leave it be
        await attempt.end_standby("lost")
        assert attempt.state is AttemptState.ENDING
        said(attempt)  # its ranks' last words while it is torn down
        return job

    job = asyncio.run(scenario())
    assert job.faults.heard == [] and job.faults.started == []

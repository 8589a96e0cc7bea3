"""The job loop against a fake launcher: no process is started (as torch elastic's agent tests do).

Each fake attempt plays a script: what its rank 0 says (signed messages over the real heartbeat
socket) and how it ends (an exit code, or never). The real Job, Attempt, decisions, heartbeat
server and event log run as in production; only the launcher is fake.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq

from contracts import env_names, locks, messages
from contracts.exit_codes import ExitCode
from supervisor.launch.plan import LaunchPlan
from supervisor.launch.processes import Exit, TeardownResult
from supervisor.launch.resolve import Resolved
from supervisor.log.events import read_events
from supervisor.run.job import Job
from supervisor.run.node_keeper import NodeKeeper
from supervisor.settings import loading


@dataclass
class Script:
    """One fake attempt: rank 0's messages, then its exit code (None: it never exits)."""

    rc: int | None = 1
    says: list[tuple[str, dict]] = field(default_factory=list)
    stop_rc: int = 0  # its exit code when asked to stop gracefully
    fails_to_start: bool = False


def hello_steps(*steps: int, resumed: int | None = None, done: bool = False):
    says = [("hello", {"phase": "init"}), ("phase", {"phase": "train", "step": 0})]
    if resumed is not None:
        says.append(("resumed", {"step": resumed, "restart_seconds": 1.0}))
    says += [("step", {"step": s, "loss": 1.0, "dt": 0.01}) for s in steps]
    if done:
        says.append(("done", {"step": steps[-1] if steps else 0}))
    return says


class FakeRunning:
    """Quacks like `processes.Launched`; its "ranks" are a script played on the event loop."""

    def __init__(self, plan: LaunchPlan, script: Script, ctx: zmq.Context) -> None:
        self.plan, self.script = plan, script
        self.started = time.monotonic()
        self.tail = collections.deque(["[0] a line of rank output"])
        self.pids: list[int] = []
        self.stop_signals = 0
        self.torn_down = 0
        self._exit: asyncio.Future[Exit] = asyncio.get_running_loop().create_future()
        self._play = asyncio.create_task(self._speak(ctx))

    async def _speak(self, ctx: zmq.Context) -> None:
        env = self.plan.procs[0].env
        key = env[env_names.ENV_HEARTBEAT_KEY].encode()
        ident = messages.RankIdentity(
            env[env_names.ENV_JOB_ID], int(env[env_names.ENV_ATTEMPT]), 0, self.plan.world,
            socket.gethostname(), 0,
        )  # fmt: skip
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(env[env_names.ENV_HEARTBEAT_ADDR])
        try:
            for kind, fields in self.script.says:
                sock.send(messages.encode(key, ident.message(kind, time.time(), **fields)))
            await asyncio.sleep(0.2)  # the supervisor reads them within 10 ms of their coming
            if self.script.rc is not None:
                self._end(self.script.rc)
        finally:
            sock.close()

    def _end(self, rc: int) -> None:
        if not self._exit.done():
            self._exit.set_result(Exit(rc, None, time.monotonic()))

    async def wait(self) -> Exit:
        return await asyncio.shield(self._exit)

    def refresh(self, extra: list[int] = ()) -> None:
        pass

    def signal_stop(self) -> None:
        self.stop_signals += 1
        asyncio.get_running_loop().call_later(0.05, self._end, self.script.stop_rc)

    async def output_read(self, timeout: float) -> None:
        pass

    def worker_pids(self) -> list[int]:
        return []

    async def teardown(self, grace: float, extra: list[int] = ()) -> TeardownResult:
        self.torn_down += 1
        alive = not self._exit.done()
        self._play.cancel()
        self._end(-signal.SIGTERM)
        return TeardownResult(int(alive), 0, [], 0.0)


class FakeLauncher:
    def __init__(self, *scripts: Script) -> None:
        self.scripts = list(scripts)
        self.started: list[FakeRunning] = []
        self.ctx = zmq.Context()

    def prepare(self) -> None:
        pass

    async def start(self, plan, output: Path, cwd, on_rank_exit) -> FakeRunning:
        script = self.scripts[min(len(self.started), len(self.scripts) - 1)]
        if script.fails_to_start:
            self.scripts.pop(0)
            raise FileNotFoundError("no such launcher")
        running = FakeRunning(plan, script, self.ctx)
        self.started.append(running)
        return running


def make_job(tmp_path: Path, fake: FakeLauncher, worker: dict | None = None, **restart) -> Job:
    cfg = loading.from_dict(
        {
            "job": {"name": "fake", "run_dir": str(tmp_path / "run")},
            "worker": worker or {},
            "heartbeat": {
                "interval_s": 0.05,
                "timeout_s": 0.5,
                "check_s": 0.02,
                "progress": {"init": 0.3, "load": 2.0, "train": 2.0, "save": 2.0},
            },
            "restart": {
                "backoff_s": [0.0, 0.05, 0.1],
                "teardown_grace_s": 0.0,
                "standby": False,  # the cold path; the standby runs real ranks (tests/e2e)
                **restart,
            },
        }
    )
    r = Resolved(cfg, tmp_path / "run", [socket.gethostname()], sys.executable, "local")
    return Job(r, console=None, launcher=fake)


@pytest.fixture(autouse=True)
def mem_root(tmp_path, monkeypatch) -> Path:
    """Each job sweeps its node's memory root at its start: here, the test's own."""
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv(env_names.ENV_MEM_ROOT, str(root))
    return root


def run(job: Job, stop_after_s: float | None = None) -> tuple[ExitCode, list[dict]]:
    async def main() -> ExitCode:
        if stop_after_s is not None:
            asyncio.get_running_loop().call_later(stop_after_s, job._on_signal, signal.SIGTERM)
        return await job.run()

    code = asyncio.run(asyncio.wait_for(main(), 30))
    return code, list(read_events(job.resolved.run_dir / "events.jsonl"))


def named(evs: list[dict], name: str) -> list[dict]:
    return [e for e in evs if e["event"] == name]


def test_failures_are_relaunched_with_backoff_until_the_budget_is_spent(tmp_path):
    fake = FakeLauncher(Script(rc=1))
    code, evs = run(make_job(tmp_path, fake, max_restarts=2))
    assert code == ExitCode.BUDGET
    assert len(fake.started) == 3 and all(a.torn_down == 1 for a in fake.started)
    # No attempt stepped: each one more unproductive in a row, so the backoff climbs.
    assert [e["delay_s"] for e in named(evs, "relaunch")] == [0.05, 0.1]
    assert [e["attempt"] for e in named(evs, "attempt_end")] == [0, 1, 2]
    (give_up,) = named(evs, "give_up")
    assert give_up["code_name"] == "BUDGET" and give_up["restarts"] == 2
    assert give_up["level"] == "error"
    assert evs[-1]["event"] == "supervisor_exit" and evs[-1]["code"] == 3


def test_a_productive_attempt_restarts_the_backoff_and_a_done_one_succeeds(tmp_path):
    fake = FakeLauncher(
        Script(rc=1),
        Script(rc=-9, says=hello_steps(1, 2, 3)),
        Script(rc=0, says=hello_steps(4, 5, resumed=3, done=True)),
    )
    code, evs = run(make_job(tmp_path, fake, max_restarts=5))
    assert code == ExitCode.DONE and len(fake.started) == 3
    assert [e["delay_s"] for e in named(evs, "relaunch")] == [0.05, 0.0]
    ends = named(evs, "attempt_end")
    assert [e["outcome"] for e in ends] == ["failure", "failure", "success"]
    assert (ends[2]["resume_step"], ends[2]["max_step"]) == (3, 5)
    (done,) = named(evs, "done")
    assert done["step"] == 5 and done["restarts"] == 2


def test_bad_input_is_not_retried(tmp_path):
    fake = FakeLauncher(Script(rc=2))
    code, evs = run(make_job(tmp_path, fake))
    assert code == ExitCode.USAGE and len(fake.started) == 1
    assert named(evs, "attempt_end")[0]["outcome"] == "bad_input"


def test_the_same_resume_step_again_and_again_is_no_progress(tmp_path):
    fake = FakeLauncher(Script(rc=1, says=hello_steps(6, resumed=5)))
    code, evs = run(make_job(tmp_path, fake, max_same_resume=2))
    assert code == ExitCode.NO_PROGRESS and len(fake.started) == 2
    assert named(evs, "give_up")[0]["resume_step"] == 5


def saved(step: int, state: str = "complete") -> tuple[str, dict]:
    return ("ckpt", {"step": step, "state": state})


def test_an_attempt_that_completed_a_newer_checkpoint_made_progress(tmp_path):
    """Issue 25: killed at steps 4, 7 and 14 with a save every 10, three attempts in a row
    resume from step 0; the third completed step 10's checkpoint, so the job goes on."""
    fake = FakeLauncher(
        Script(rc=-9, says=hello_steps(*range(1, 5))),
        Script(rc=-9, says=hello_steps(*range(1, 8))),
        Script(rc=-9, says=[*hello_steps(*range(1, 15)), saved(10)]),
        Script(rc=0, says=hello_steps(*range(11, 17), resumed=10, done=True)),
    )
    code, evs = run(make_job(tmp_path, fake, max_same_resume=3))
    assert code == ExitCode.DONE and len(fake.started) == 4
    ends = named(evs, "attempt_end")
    assert [(e["resume_step"], e["ckpt_complete"]) for e in ends] == [
        (0, None), (0, None), (0, 10), (10, None)
    ]  # fmt: skip
    assert not named(evs, "give_up") and all("mem_complete" not in e for e in ends)


def test_a_memory_copy_is_progress_too(tmp_path):
    """No durable checkpoint at all, a memory copy in each attempt: the job goes on; the
    same attempts without the copies stop it (max_same_resume = 2)."""
    fake = FakeLauncher(
        Script(rc=-9, says=[*hello_steps(1, 2, 3, 4), saved(3, "memory")]),
        Script(rc=-9, says=[*hello_steps(4, 5, 6, resumed=3), saved(6, "memory")]),
        Script(rc=0, says=hello_steps(7, 8, resumed=6, done=True)),
    )
    code, evs = run(make_job(tmp_path, fake, max_same_resume=2, max_restarts=5))
    assert code == ExitCode.DONE
    ends = named(evs, "attempt_end")
    assert [e.get("mem_complete") for e in ends] == [3, 6, None]
    assert [e["ckpt_complete"] for e in ends] == [None, None, None]
    fake = FakeLauncher(
        Script(rc=-9, says=hello_steps(1, 2, 3, 4)),
        Script(rc=-9, says=hello_steps(1, 2, 3)),
    )
    code, evs = run(make_job(tmp_path / "b", fake, max_same_resume=2, max_restarts=5))
    assert code == ExitCode.NO_PROGRESS and len(fake.started) == 2
    assert named(evs, "give_up")[0]["reason"] == (
        "no progress: 2 attempts in a row resumed from step 0 and completed no newer checkpoint"
    )


def test_attempts_that_never_exit_are_judged_and_torn_down(tmp_path):
    # The first never says hello (init timeout), the second goes silent after it (a hang).
    silent, hung = Script(rc=None), Script(rc=None, says=hello_steps(1))
    fake = FakeLauncher(silent, hung)
    code, evs = run(make_job(tmp_path, fake, max_restarts=1))
    assert code == ExitCode.BUDGET
    assert [e["detected_by"] for e in named(evs, "attempt_end")] == ["no_progress", "hang"]
    assert [e["reason"] for e in named(evs, "teardown")] == ["no_progress", "hang"]
    assert [e["terminated"] for e in named(evs, "teardown_done")] == [1, 1]


def test_a_launch_that_cannot_start_is_a_failure_worth_a_retry(tmp_path):
    fake = FakeLauncher(Script(fails_to_start=True), Script(rc=0, says=hello_steps(1, done=True)))
    code, evs = run(make_job(tmp_path, fake))
    assert code == ExitCode.DONE
    assert "no such launcher" in named(evs, "launch_failed")[0]["error"]
    assert [e["outcome"] for e in named(evs, "attempt_end")] == ["failure", "success"]


def test_a_user_stop_is_graceful_and_not_an_error(tmp_path):
    fake = FakeLauncher(Script(rc=None, says=hello_steps(1)))
    code, evs = run(make_job(tmp_path, fake, stop_grace_s=5.0), stop_after_s=0.3)
    assert code == ExitCode.INTERRUPTED and fake.started[0].stop_signals == 1
    names = [e["event"] for e in evs]
    for name in ("signal", "stop", "exit", "teardown", "attempt_end", "give_up"):
        assert name in names
    (end,) = named(evs, "attempt_end")
    assert end["outcome"] == "stopped" and end["detected_by"] == "stop"
    assert named(evs, "exit")[0]["stopped"] is True
    assert {e["level"] for e in evs} <= {"info", "warning"}
    assert named(evs, "give_up")[0]["level"] == "warning"


def test_a_stop_before_the_first_launch_launches_nothing(tmp_path, monkeypatch):
    fake = FakeLauncher(Script(rc=0, says=hello_steps(1, done=True)))
    job = make_job(tmp_path, fake)

    async def node_check_interrupted(keeper):  # SIGHUP while the nodes are checked
        job._on_signal(signal.SIGHUP)

    monkeypatch.setattr(NodeKeeper, "check", node_check_interrupted)
    code, evs = run(job)
    assert code == ExitCode.INTERRUPTED and fake.started == []
    assert named(evs, "signal")[0]["signal"] == "SIGHUP"
    assert named(evs, "give_up")[0]["reason"] == "interrupted before the first launch"
    assert evs[-1]["event"] == "supervisor_exit" and evs[-1]["code"] == 5


def test_a_stop_during_backoff_ends_the_job_at_once(tmp_path):
    fake = FakeLauncher(Script(rc=1))
    t0 = time.monotonic()
    job = make_job(tmp_path, fake, backoff_s=[30.0])
    code, evs = run(job, stop_after_s=1.5)
    assert code == ExitCode.INTERRUPTED and len(fake.started) == 1
    assert time.monotonic() - t0 < 10
    assert named(evs, "give_up")[0]["reason"] == "interrupted during backoff"


def test_each_attempt_keeps_its_own_table(tmp_path):
    fake = FakeLauncher(
        Script(rc=1, says=hello_steps(1, 2)), Script(rc=0, says=hello_steps(1, done=True))
    )
    code, evs = run(make_job(tmp_path, fake))
    assert code == ExitCode.DONE
    assert [e["max_step"] for e in named(evs, "attempt_end")] == [2, 1]
    assert [e["rank"] for e in named(evs, "rank_hello")] == [0, 0]


def test_a_full_run_dir_never_stops_the_job(tmp_path, monkeypatch):
    import errno

    from supervisor.log import events as events_mod

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    fake = FakeLauncher(Script(rc=1), Script(rc=0, says=hello_steps(1, 2, done=True)))
    job = make_job(tmp_path, fake, max_restarts=3)
    monkeypatch.setattr(events_mod.os, "write", full)  # every event from the first on
    code, evs = run(job)
    assert code == ExitCode.DONE and len(fake.started) == 2  # supervised and relaunched
    assert job.events_failing == "No space left on device"
    assert evs == []


MEM = {"mem_ckpt_interval": 1}


@pytest.mark.parametrize(
    "scripts,restart,stop_after_s,code",
    [
        ([Script(rc=0, says=hello_steps(1, done=True))], {}, None, ExitCode.DONE),
        ([Script(rc=1)], {"max_restarts": 1}, None, ExitCode.BUDGET),
        ([Script(rc=1, says=hello_steps(6, resumed=5))], {"max_same_resume": 2}, None,
         ExitCode.NO_PROGRESS),
        ([Script(rc=None, says=hello_steps(1))], {"stop_grace_s": 5.0}, 0.3,
         ExitCode.INTERRUPTED),
    ],
    ids=["done", "budget", "no_progress", "interrupted"],
)  # fmt: skip
def test_the_memory_dir_is_held_for_the_job_and_removed_however_it_ends(
    tmp_path, mem_root, scripts, restart, stop_after_s, code
):
    fake = FakeLauncher(*scripts)
    job = make_job(tmp_path, fake, worker=MEM, **restart)
    seen: list[bool] = []
    start = fake.start

    async def start_and_look(plan, *args):  # the directory is there while the ranks run
        seen.append((mem_root / f"es-mem-{job.job_id}").is_dir())
        return await start(plan, *args)

    fake.start = start_and_look
    got, evs = run(job, stop_after_s)
    assert got == code and seen and all(seen)
    path = str(mem_root / f"es-mem-{job.job_id}")
    assert named(evs, "mem_held")[0]["path"] == path
    assert named(evs, "mem_removed")[0]["path"] == path
    assert list(mem_root.iterdir()) == []
    names = [e["event"] for e in evs]
    assert names.index("mem_held") < names.index("launch")
    assert names.index("mem_removed") < names.index("supervisor_exit")


def test_an_internal_error_removes_the_memory_dir_too(tmp_path, mem_root, monkeypatch):
    job = make_job(tmp_path, FakeLauncher(Script(rc=0)), worker=MEM)

    async def broken(first: int):
        raise RuntimeError("a bug")

    monkeypatch.setattr(job, "_attempts", broken)
    with pytest.raises(RuntimeError):
        run(job)
    evs = list(read_events(job.resolved.run_dir / "events.jsonl"))
    assert named(evs, "mem_removed") and list(mem_root.iterdir()) == []
    assert named(evs, "supervisor_exit")[0]["code_name"] == "ERROR"


def test_dead_jobs_memory_dirs_are_swept_before_the_first_launch(tmp_path, mem_root):
    dead = mem_root / "es-mem-dead-0000dead"
    fd = locks.hold_mem_dir(dead)  # a job that died: its holder is gone
    os.close(fd)
    (dead / "slot").write_bytes(b"x")
    live = mem_root / "es-mem-live-0000aaaa"
    fd = locks.hold_mem_dir(live)  # a job alive on this node
    try:
        fake = FakeLauncher(Script(rc=0, says=hello_steps(1, done=True)))
        code, evs = run(make_job(tmp_path, fake))  # no memory tier of its own: sweeps anyway
        assert code == ExitCode.DONE
        (sweep,) = named(evs, "mem_sweep")
        assert sweep["paths"] == [str(dead)] and sweep["root"] == str(mem_root)
        assert not dead.exists() and live.is_dir()
        assert not named(evs, "mem_held") and not named(evs, "mem_removed")
        names = [e["event"] for e in evs]
        assert names.index("mem_sweep") < names.index("launch")
        code, evs = run(make_job(tmp_path / "again", fake))
        assert not named(evs, "mem_sweep")  # nothing removed: no event
    finally:
        os.close(fd)

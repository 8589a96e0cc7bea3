"""Issue 25 end to end: the real supervisor, real mpiexec and the real worker (tiny model, 2 ranks)
or light fake ranks (the real beacon, no torch), real signals.

- SIGHUP (a closed terminal, an SSH drop) is a graceful stop like SIGTERM, even with the console
  gone (every write to it fails), and ends a standby that is still starting at once;
- a warning a rank printed is never the attempt's error; a supervisor started with SIGHUP ignored
  (nohup) keeps it ignored;
- a job that decided to end does so at once, ending a standby that is still starting;
- an attempt that completed a checkpoint newer than its resume step made progress: durable, or a
  copy of the memory tier (that job also shows the memory root swept of a dead job's directory
  at the start, a live job's kept, and its own held for its life and removed at its end).
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from contracts import locks
from tests.support import (
    TINY_JOB_WORKER,
    assert_in_order,
    events,
    finish_supervisor,
    job_toml,
    start_supervisor,
    wait_for,
)

pytestmark = pytest.mark.slow

JOB_TIMEOUT = 240


def write_config(tmp_path: Path, worker: dict, restart: dict | None = None,
                 launch: dict | None = None, env: dict | None = None,
                 faults: tuple[dict, ...] = ()) -> Path:  # fmt: skip
    return job_toml(tmp_path, {
        "job": {"name": "h", "run_dir": str(tmp_path / "run")},
        "launch": {"launcher": "mpiexec", "ranks_per_node": 2, **(launch or {})},
        "launch.env": {"OMP_NUM_THREADS": "1", **(env or {})},
        "worker": worker,
        "restart": {"max_restarts": 5, "teardown_grace_s": 3.0, "backoff_s": [0],
                    "standby": False, **(restart or {})},
        "heartbeat": {"interval_s": 0.25, "timeout_s": 5.0},
        "heartbeat.progress": {"init": 120, "load": 120, "train": 60, "save": 120},
    }, faults)  # fmt: skip


def start(config: Path, **popen) -> subprocess.Popen:
    return start_supervisor(config, **popen)


def finish(proc: subprocess.Popen, timeout: float = JOB_TIMEOUT) -> tuple[int, str]:
    return finish_supervisor(proc, timeout)


def job_processes(job: str) -> list[psutil.Process]:
    """Every live process of the job (its ranks carry ES_JOB_ID in their environment)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("ES_JOB_ID") == job and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def assert_nothing_left(run: Path) -> None:
    job = next(e for e in events(run) if e["event"] == "start")["job"]
    deadline = time.monotonic() + 10
    while job_processes(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not job_processes(job), f"processes of {job} outlived the supervisor"


def named(evs: list[dict], name: str) -> list[dict]:
    return [e for e in evs if e["event"] == name]


class Terminal:
    """A pseudo-terminal as the supervisor's console, read until `hang_up` closes it: from then
    on every write to it fails (EIO), as after a closed terminal window or an SSH drop."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        self.text = b""
        self._open = True
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while self._open:
            ready, _, _ = select.select([self.master], [], [], 0.05)
            if ready:
                try:
                    self.text += os.read(self.master, 65536)
                except OSError:
                    return

    def hang_up(self) -> None:
        self._open = False
        self._thread.join()
        os.close(self.master)


def test_sighup_is_a_graceful_stop_with_the_console_gone(tmp_path, mem_root):
    """SIGHUP after the terminal closed, while a standby is starting: the ranks save and stop,
    scratch is removed, the report is written, exit 5; no write to the dead console kills it."""
    run = tmp_path / "run"
    worker = {**TINY_JOB_WORKER, "train_iters": 5000, "save_interval": 0, "mem_ckpt_interval": 5}
    config = write_config(tmp_path, worker, restart={"standby": True},
                          env={"ES_MEM_ROOT": str(mem_root)})  # fmt: skip
    tty = Terminal()
    # SIGHUP as a terminal's shell leaves it (the default), even when this test runs under nohup
    # (which the supervisor would honour: it keeps an ignored SIGHUP ignored).
    proc = start(config, stdout=tty.slave, stderr=tty.slave, stdin=subprocess.DEVNULL,
                 start_new_session=True,
                 preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))  # fmt: skip
    os.close(tty.slave)
    try:
        first = wait_for(run, lambda e: e["event"] == "first_step", proc, timeout=120)
        wait_for(run, lambda e: e["event"] == "standby_launch", proc, timeout=120)
        assert b"first_step" in tty.text  # the console worked until now
        tty.hang_up()
        proc.send_signal(signal.SIGHUP)
        rc, _ = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
        print(tty.text.decode(errors="replace")[-3000:])
    evs = events(run)
    seen = [e["event"] for e in evs]
    print("events after SIGHUP:", seen[seen.index("signal") :] if "signal" in seen else seen[-5:])
    print("rc:", rc)
    assert rc == 5
    (sig,) = named(evs, "signal")
    assert sig["signal"] == "SIGHUP"
    order = ["signal", "stop", "exit", "attempt_end", "give_up", "mem_removed", "supervisor_exit"]
    it = iter(seen)
    assert all(name in it for name in order), seen
    assert named(evs, "supervisor_exit")[0]["code_name"] == "INTERRUPTED"
    assert named(evs, "exit")[0].get("stopped") and named(evs, "exit")[0]["returncode"] == 0
    marks = sorted(int(p.parent.name[5:]) for p in (run / "ckpt").glob("step-*/.complete"))
    assert marks and marks[-1] > first["step"]  # the steps since the last save were saved
    assert not list(mem_root.iterdir())  # the memory tier's directory is gone
    # The standby (still starting) was ended with the job, not waited for.
    (standby_exit,) = named(evs, "standby_exit")
    assert standby_exit["reason"] == "job over" and standby_exit["survivors"] == 0
    assert (run / "report.md").is_file()  # the end-of-run report, though nobody could read it
    assert_nothing_left(run)


FAKE_RANK = """
import os, signal, time
from worker.beat import Beacon
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
b = Beacon.from_env(rank, world)
b.hello("init")
if rank == 0:
    print("WARNING: memory tier off: a copy failed (OSError: [Errno 28] No space left on device)",
          flush=True)
b.phase("train", 0)
for step in range(1, 400):
    time.sleep(0.05)
    b.step(step, 1.0, 0.05)
b.done(step)
b.close()
"""


def test_a_warning_is_not_the_error_and_an_ignored_sighup_stays_ignored(tmp_path):
    """Light ranks; rank 0 warns, then a fault kills every rank. Started as under nohup."""
    (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
    kill = {"name": "kill", "at_step": 5, "action": "kill", "target": "all"}
    config = write_config(tmp_path, {"module": "fake_rank"}, restart={"max_restarts": 0},
                          launch={"launcher": "local", "cwd": str(tmp_path)},
                          faults=(kill,))  # fmt: skip
    run = tmp_path / "run"
    proc = start(config, preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        wait_for(run, lambda e: e["event"] == "launch", proc, timeout=60)
        proc.send_signal(signal.SIGHUP)  # nohup's job: it must not stop the job
        rc, out = finish(proc, 90)
    finally:
        if proc.poll() is None:
            proc.kill()
    evs = events(run)
    (end,) = named(evs, "attempt_end")
    print("attempt_end:", {k: end.get(k) for k in ("outcome", "detail", "detected_by", "error")})
    assert rc == 3, out  # the budget (no restarts), not an interrupt
    assert not named(evs, "signal")
    assert named(evs, "fault")[0]["action"] == "kill" and end["detected_by"] in (
        "exit",
        "rank_exit",
    )
    assert "WARNING: memory tier off" in out  # shown among the attempt's last lines ...
    assert end["error"] is None  # ... but it is not the attempt's error


def test_a_job_that_gives_up_ends_a_starting_standby_at_once(tmp_path):
    """No restarts left; the kill at step 3 comes while the standby (launched at step 1) is
    still starting: the job ends without waiting for it."""
    run = tmp_path / "run"
    kill = {"name": "kill", "at_step": 3, "action": "kill", "target": "all"}
    worker = {**TINY_JOB_WORKER, "train_iters": 200, "save_interval": 0}
    config = write_config(tmp_path, worker, restart={"max_restarts": 0, "standby": True},
                          faults=(kill,))  # fmt: skip
    proc = start(config)
    try:
        rc, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    evs = events(run)
    (give_up,) = named(evs, "give_up")
    (final,) = named(evs, "supervisor_exit")
    took = final["mono"] - give_up["mono"]
    standby = named(evs, "standby_launch")
    hellos = [
        e for e in named(evs, "rank_hello") if standby and e["attempt"] == standby[0]["attempt"]
    ]
    print(
        f"give_up -> supervisor_exit: {took:.2f} s; standby hellos before the end: "
        f"{[round(e['mono'] - give_up['mono'], 2) for e in hellos]}"
    )
    assert rc == 3, out
    assert give_up["code_name"] == "BUDGET"
    assert standby and not named(evs, "standby_ready"), "the standby was ready: too slow a kill"
    (standby_exit,) = named(evs, "standby_exit")
    assert standby_exit["reason"] == "job over" and standby_exit["survivors"] == 0
    assert took < 2.0, f"the job took {took:.2f} s to end after it gave up"
    assert_nothing_left(run)


def test_an_attempt_that_completed_a_newer_checkpoint_made_progress(tmp_path):
    """Every rank killed at steps 4 and 14, a save every 10, two attempts in a row allowed the
    same resume step: both resume from step 0, but the second completed the checkpoint of
    step 10, so the job goes on and the third resumes there."""
    run = tmp_path / "run"
    kill = {"name": "kill", "at_step": [4, 14], "action": "kill", "target": "all"}
    worker = {**TINY_JOB_WORKER, "train_iters": 16, "save_interval": 10, "mem_ckpt_interval": 0}
    proc = start(write_config(tmp_path, worker, restart={"max_same_resume": 2}, faults=(kill,)))
    rc, out = finish(proc)
    evs = events(run)
    ends = named(evs, "attempt_end")
    print("attempt_end:", [(e["attempt"], e["resume_step"], e["ckpt_complete"], e["outcome"])
                           for e in ends])  # fmt: skip
    print("exit:", rc, named(evs, "supervisor_exit")[0]["reason"])
    assert rc == 0, out[-3000:]
    assert [e["resume_step"] for e in ends] == [0, 0, 10]
    assert [e["ckpt_complete"] for e in ends[:2]] == [None, 10]
    assert [e["step"] for e in named(evs, "fault")] == [4, 14]
    assert not named(evs, "give_up")


def test_a_memory_tier_copy_is_progress(tmp_path, mem_root):
    """No durable save before the kills (steps 4, 10), a memory copy every step, two attempts in
    a row allowed the same resume step: each attempt resumes from the memory copy the one before
    it made, and the job completes. The memory root also holds a dead job's directory (held by
    nobody: swept at the start) and a live job's (held: kept); the job's own is held for its
    life and removed at its end."""
    run = tmp_path / "run"
    dead = mem_root / "es-mem-dead-0000dead"  # a job killed outright
    os.close(locks.hold_mem_dir(dead))
    (dead / "slot-0").write_bytes(b"x" * 64)
    alive = mem_root / "es-mem-alive-0000aaaa"  # a job still running on this node
    fd = locks.hold_mem_dir(alive)
    # Step 10: the attempt resumed after the kill at 4 (from a step up to 6) says a newer copy
    # before it is killed (a copy of step k is said during step k + 2).
    kill = {"name": "kill", "at_step": [4, 10], "action": "kill", "target": "all"}
    worker = {**TINY_JOB_WORKER, "train_iters": 14, "save_interval": 100, "mem_ckpt_interval": 1}
    config = write_config(tmp_path, worker, restart={"max_same_resume": 2},
                          env={"ES_MEM_ROOT": str(mem_root)}, faults=(kill,))  # fmt: skip
    try:
        rc, out = finish(start(config))
        left = sorted(p.name for p in mem_root.iterdir())
    finally:
        os.close(fd)
    evs = events(run)
    ends = named(evs, "attempt_end")
    print("attempt_end:", [(e["attempt"], e["resume_step"], e.get("resume_source"),
                            e["ckpt_complete"], e.get("mem_complete")) for e in ends])  # fmt: skip
    assert rc == 0, out[-3000:]
    assert len(ends) == 3 and all(e["ckpt_complete"] is None for e in ends[:2])
    for before, after in zip(ends, ends[1:], strict=False):
        # What the supervisor heard of the memory tier is what the next attempt resumed from
        # (or, when the kill beat the last copy's word, a step before it).
        assert before["resume_step"] < before["mem_complete"] <= after["resume_step"]
        assert after["resume_source"] == "memory"
    (sweep,) = named(evs, "mem_sweep")
    assert sweep["paths"] == [str(dead)]
    job = named(evs, "start")[0]["job"]
    mine = str(mem_root / f"es-mem-{job}")
    assert [e["path"] for e in named(evs, "mem_held")] == [mine]
    assert [e["path"] for e in named(evs, "mem_removed")] == [mine]
    # its own held first (a continued job's copies are never swept), then the sweep
    order = ["start", "mem_held", "mem_sweep", "launch", "done", "mem_removed", "supervisor_exit"]
    assert_in_order([e["event"] for e in evs], order)
    assert left == ["es-mem-alive-0000aaaa"]

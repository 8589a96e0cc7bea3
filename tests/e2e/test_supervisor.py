"""End to end: the real supervisor runs the real worker (tiny model, 2 ranks) under real launchers.

Failures are real too: SIGKILL and SIGSTOP from the test to a rank's pid (taken from the run's own
`rank_hello` events), the worker's injected raise and stall, and signals to the supervisor.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import psutil
import pytest
import zmq

from tests.support import (
    TINY_JOB_WORKER,
    assert_in_order,
    events,
    inject_env,
    names,
    rank_pid,
    supervisor_cli,
    tiered,
    toml_value,
    wait_for,
)
from tests.support import finish_supervisor as _finish
from tests.support import start_supervisor as start

JOB_TIMEOUT = 150


def finish(proc, timeout: float = JOB_TIMEOUT) -> tuple[int, str]:
    return _finish(proc, timeout)


TINY = {**TINY_JOB_WORKER, "train_iters": 30, "save_interval": 5}


def write_config(tmp_path: Path, launcher="mpiexec", worker=None, restart=None, heartbeat=None,
                 progress=None, inject=None) -> Path:  # fmt: skip
    """A job config; `inject`: the test-only failure points to arm in its ranks."""
    tables = {
        "job": {"name": "t", "run_dir": str(tmp_path / "run")},
        "launch": {"launcher": launcher, "ranks_per_node": 2},
        "worker": {**TINY, **(worker or {})},
        # The cold path (the standby has tests/e2e/test_standby.py).
        "restart": {
            "max_restarts": 3,
            "teardown_grace_s": 1.0,
            "standby": False,
            **(restart or {}),
        },  # fmt: skip
        "heartbeat": {"interval_s": 0.25, "timeout_s": 3.0, **(heartbeat or {})},
        "heartbeat.progress": {"init": 60, "load": 60, "train": 30, "save": 60, **(progress or {})},
    }
    if inject:
        tables["launch.env"] = inject_env(**inject)
    text = "".join(
        f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in t.items()) + "\n"
        for name, t in tables.items()
    )
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_job_completes_with_the_run_dir_layout(tmp_path):
    run = tmp_path / "run"
    proc = start(write_config(tmp_path, worker={"train_iters": 12}))
    # Junk at the heartbeat socket while the job runs: dropped, counted, and the job goes on.
    address = wait_for(run, lambda e: e["event"] == "start", proc)["heartbeat"]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(address)
    for junk in (b"x" * 100, b"not signed at all", pickle.dumps({"kind": "beat"}) * 3):
        push.send(junk)
    push.close()
    ctx.term()
    rc, out = finish(proc)
    assert rc == 0, out
    final = next(e for e in events(run) if e["event"] == "supervisor_exit")
    assert sum(final["dropped"].values()) == 3
    assert (run / "config.toml").is_file()
    a0 = run / "attempts" / "000"
    assert {"command.txt", "output.log", "metrics-0.jsonl"} <= {p.name for p in a0.iterdir()}
    assert "-prepend-rank" in (a0 / "command.txt").read_text()
    evs = events(run)
    assert_in_order(names(evs), ["start", "launch", "rank_hello", "first_step", "ckpt_complete",
                                 "exit", "teardown", "done", "supervisor_exit"])  # fmt: skip
    assert all("ts" in e and "mono" in e for e in evs)
    done = next(e for e in evs if e["event"] == "done")
    assert done["step"] == 12
    status = supervisor_cli("status", str(run))
    assert status.returncode == 0
    assert "finished: DONE" in status.stdout and "step 12" in status.stdout
    tail = supervisor_cli("tail", str(run))
    assert "supervisor_exit" in tail.stdout and "first_step" in tail.stdout


def test_killed_rank_relaunch_resume_done(tmp_path):
    run = tmp_path / "run"
    # Enough steps after the checkpoint that the kill lands while the ranks train, however
    # loaded the machine is.
    proc = start(write_config(tmp_path, worker={"train_iters": 120}))
    wait_for(run, lambda e: e["event"] == "ckpt_complete" and e["step"] >= 10, proc)
    os.kill(rank_pid(run, 1, 0), signal.SIGKILL)
    rc, out = finish(proc)
    assert rc == 0, out
    evs = events(run)
    # Detected by the launcher's exit, or (when the launcher is slow to follow its rank) by
    # the rank's own exit on this host: either way before teardown.
    detected = next(e for e in evs if e["event"] in ("exit", "rank_exit") and e["attempt"] == 0)
    expected = ["launch", detected["event"], "teardown", "teardown_done", "attempt_end",
                "relaunch", "launch", "resumed", "first_step", "exit", "done"]  # fmt: skip
    assert_in_order(names(evs), expected)
    if detected["event"] == "exit":
        assert detected["returncode"] != 0 and not detected["said_done"]
    else:
        assert 1 in detected["ranks"]  # the killed rank (Hydra may have ended rank 0 too)
    teardown = next(e for e in evs if e["event"] == "teardown" and e["attempt"] == 0)
    assert teardown["latency_s"] <= 0.2
    resumed = next(e for e in evs if e["event"] == "resumed")
    assert resumed["attempt"] == 1 and resumed["step"] >= 10 and resumed["restart_seconds"] > 0
    first = next(e for e in evs if e["event"] == "first_step" and e["attempt"] == 1)
    assert first["step"] == resumed["step"] + 1
    assert f"RESUMED from step={resumed['step']}" in (run / "attempts/001/output.log").read_text()


@pytest.mark.slow
def test_stopped_rank_is_a_liveness_loss(tmp_path):
    run = tmp_path / "run"
    worker = {"train_iters": 300, "save_interval": 50}
    proc = start(write_config(tmp_path, launcher="local", worker=worker))
    wait_for(run, lambda e: e["event"] == "first_step", proc)
    pid = rank_pid(run, 1, 0)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    hang = wait_for(run, lambda e: e["event"] == "hang", proc, timeout=30)
    # Detected within timeout + 0.5 s of the last beat (here measured from the SIGSTOP).
    assert hang["ranks"] == [1] and hang["latency_s"] <= 0.5
    assert hang["detected_mono"] - stopped_at <= 3.0 + 0.5 + 0.3
    wait_for(run, lambda e: e["event"] == "launch" and e["attempt"] == 1, proc, timeout=30)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    # A second signal does not wait for the graceful stop.
    proc.send_signal(signal.SIGTERM)
    wait_for(run, lambda e: e["event"] == "stop", proc, timeout=30)
    t0 = time.monotonic()
    if proc.poll() is None:  # the fresh ranks may already have stopped at the first signal
        proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc)
    assert rc == 5, out
    assert time.monotonic() - t0 < 10


@pytest.mark.slow
def test_stall_inside_a_step_is_a_progress_loss(tmp_path):
    run = tmp_path / "run"
    config = write_config(
        tmp_path,
        launcher="local",
        worker={"save_interval": 0},
        inject={"rank": 1, "stall_at_step": 3},
        restart={"max_restarts": 0},
        progress={"train": 2.5},
    )
    rc, out = finish(start(config))
    assert rc == 3, out  # the budget (no restarts) is spent
    evs = events(run)
    (stall,) = [e for e in evs if e["event"] == "no_progress"]
    # Rank 1 stalls inside step 3 and rank 0 waits for it in the step's collective: from
    # outside both look the same, and whichever passed its deadline first is reported.
    assert set(stall["ranks"]) <= {0, 1} and stall["phase"] == "train" and stall["step"] == 2
    assert stall["latency_s"] <= 0.5
    end = next(e for e in evs if e["event"] == "attempt_end")
    assert end["detected_by"] == "no_progress"
    assert not any(e["event"] == "hang" for e in evs)  # it kept beating


FAKE_RANK = """
import os, time
from worker.beat import Beacon
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
b = Beacon.from_env(rank, world)
b.hello("init")
b.phase("load", 0)
b.phase("train", 5)
for step in (6, 7):
    time.sleep(0.05)
    b.step(step, 1.0, 0.05)
    if step == 6:
        b.resumed(5, 0.1)
b.close()
raise SystemExit(1 if rank == 1 else 0)
"""


@pytest.mark.slow
def test_same_resume_step_again_and_again_is_no_progress(tmp_path):
    """Light ranks (the real beacon, no torch) that always resume from step 5 and die at 7."""
    (tmp_path / "fake_rank.py").write_text(FAKE_RANK)
    config = write_config(tmp_path, launcher="local", restart={"max_same_resume": 3,
                                                               "backoff_s": [0, 0.1]})  # fmt: skip
    text = config.read_text().replace("[worker]\n", '[worker]\nmodule = "fake_rank"\n', 1)
    text = text.replace("[launch]\n", f'[launch]\ncwd = "{tmp_path}"\n', 1)
    config.write_text("\n".join(line for line in text.splitlines()
                                if not line.startswith(tuple(TINY))) + "\n")  # fmt: skip
    rc, out = finish(start(config), 60)
    assert rc == 4, out
    evs = events(tmp_path / "run")
    assert [e["step"] for e in evs if e["event"] == "resumed"] == [5, 5, 5]
    give_up = next(e for e in evs if e["event"] == "give_up")
    assert give_up["code_name"] == "NO_PROGRESS" and give_up["resume_step"] == 5
    # Each attempt stepped past its resume step (progress within it), so no backoff: it is
    # the same resume step three times that stops the job.
    assert [e["delay_s"] for e in evs if e["event"] == "relaunch"] == [0.0, 0.0]


@pytest.mark.slow
def test_budget_exhausted(tmp_path):
    run = tmp_path / "run"
    config = write_config(
        tmp_path,
        launcher="local",
        inject={"rank": 0, "raise_at_step": 3},
        restart={"max_restarts": 0},
    )
    rc, out = finish(start(config))
    assert rc == 3, out
    assert "injected failure at step 3" in out  # the failed attempt's last lines are shown
    evs = events(run)
    assert sum(e["event"] == "launch" for e in evs) == 1
    assert any(e["event"] == "rank_error" and "injected" in e["message"] for e in evs)
    assert next(e for e in evs if e["event"] == "give_up")["code_name"] == "BUDGET"


@pytest.mark.slow
def test_the_same_error_before_the_first_step_twice_ends_the_job(tmp_path):
    run = tmp_path / "run"
    config = write_config(
        tmp_path,
        launcher="local",
        inject={"rank": 0, "raise_at_step": 1},  # fails inside its first step
        restart={"max_restarts": 5, "backoff_s": [0, 1, 30]},
    )
    rc, out = finish(start(config))
    assert rc == 4, out
    evs = events(run)
    assert sum(e["event"] == "launch" for e in evs) == 2  # not 6, and no 30 s backoff
    assert [e["delay_s"] for e in evs if e["event"] == "relaunch"] == [1.0]
    give_up = next(e for e in evs if e["event"] == "give_up")
    assert give_up["code_name"] == "NO_PROGRESS"
    assert give_up["reason"] == (
        "2 attempts in a row failed before their first step with: "
        "RuntimeError: injected failure at step 1"
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_checkpoint_disk_ends_the_job_in_one_line(tmp_path, mode):
    run = tmp_path / "run"
    worker = {}
    if mode == "async":
        worker.update(async_ckpt=True, ckpt_stage_dir=str(tmp_path / "stage"))
    disk_full = {"rank": 0, "disk_full_at_step": 10}  # ENOSPC writing the shard
    rc, out = finish(start(write_config(tmp_path, worker=worker, inject=disk_full)))
    assert rc == 2, out
    evs = events(run)
    assert sum(e["event"] == "launch" for e in evs) == 1  # no relaunch can make room
    give_up = next(e for e in evs if e["event"] == "give_up")
    where = f"ckpt-dir {run / 'ckpt'}" if mode == "sync" else f"{tmp_path / 'stage'}"
    assert give_up["reason"].startswith(f"disk full: {where}")
    assert "at the save of step 10 (No space left on device)" in give_up["reason"]
    assert "Traceback" not in out and "CheckpointException" not in out
    errors = [e["message"] for e in evs if e["event"] == "rank_error"]
    assert errors and all(len(m) < 400 for m in errors)  # one line each, no DCP traceback
    ckpt = run / "ckpt"
    assert not (ckpt / "step-10").exists()  # the partial save is gone at once
    assert (ckpt / "step-5" / ".complete").exists()  # the newest complete one stays


@pytest.mark.slow
def test_worker_rejecting_its_flags_is_exit_2(tmp_path):
    # What a token file holds is the worker's to check (the supervisor checks only that it is
    # there, and only where the ranks run on this host).
    tokens = tmp_path / "short-tokens.bin"
    tokens.write_bytes(b"\0\0" * 8)  # 8 uint16 tokens: fewer than --seq-len + 1
    rc, out = finish(start(write_config(tmp_path, launcher="local",
                                        worker={"data_path": str(tokens)})))  # fmt: skip
    assert rc == 2, out
    assert "short-tokens.bin holds 8 tokens; need more than --seq-len + 1" in out
    assert f"run dir: {tmp_path / 'run'}" in out
    assert "==" not in out and "Per failure" not in out  # no report of a run that never ran
    assert sum(e["event"] == "launch" for e in events(tmp_path / "run")) == 1


def test_bad_worker_flag_is_refused_before_launch(tmp_path):
    rc, out = finish(start(write_config(tmp_path, launcher="local", worker={"model": "nope"})))
    assert rc == 2, out
    assert "worker.model: --model: unknown model preset 'nope'" in out
    assert not (tmp_path / "run" / "events.jsonl").exists()


def test_supervisor_sigterm_stops_gracefully_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    config = write_config(tmp_path, worker={"train_iters": 5000, "save_interval": 0})
    proc = start(config)
    first = wait_for(run, lambda e: e["event"] == "first_step", proc)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    rc, out = finish(proc)
    assert rc == 5, out
    evs = events(run)
    assert_in_order(names(evs), ["signal", "stop", "exit", "teardown", "give_up",
                                 "supervisor_exit"])  # fmt: skip
    stop_exit = next(e for e in evs if e["event"] == "exit")
    assert stop_exit.get("stopped") and stop_exit["returncode"] == 0
    marks = sorted(int(p.parent.name[5:]) for p in (run / "ckpt").glob("step-*/.complete"))
    assert marks and marks[-1] > first["step"]
    status = supervisor_cli("status", str(run))
    assert f"checkpoint: step {marks[-1]}" in status.stdout
    assert "INTERRUPTED" in status.stdout


def test_a_second_supervisor_on_a_running_jobs_dirs_is_refused(tmp_path):
    run = tmp_path / "run"
    config = write_config(tmp_path, launcher="local", worker={"train_iters": 5000})
    first = start(config)
    try:
        wait_for(run, lambda e: e["event"] == "first_step", first)
        started = time.monotonic()
        rc, out = finish(start(config), timeout=60)  # the same run dir and checkpoint dir
        assert rc == 2, out
        assert time.monotonic() - started < 30  # at once, not after a launch
        assert f"{run}: run dir in use: job t-" in out and f"(pid {first.pid} on " in out
        # Another run dir, the same checkpoint dir: refused too.
        (tmp_path / "b").mkdir()
        other = write_config(
            tmp_path / "b", launcher="local", worker={"ckpt_dir": str(run / "ckpt")}
        )
        rc, out = finish(start(other), timeout=60)
        assert rc == 2 and f"{run / 'ckpt'}: checkpoint dir in use: job t-" in out, out
        assert sum(e["event"] == "start" for e in events(run)) == 1
        assert not (tmp_path / "b" / "run" / "events.jsonl").exists()
    finally:
        first.send_signal(signal.SIGTERM)
        finish(first)


@pytest.mark.parametrize("launcher", tiered(["mpiexec", "local"], "mpiexec"))
def test_supervisor_sigkill_leaves_no_rank(tmp_path, launcher):
    run = tmp_path / "run"
    proc = start(write_config(tmp_path, launcher=launcher, worker={"train_iters": 5000}))
    wait_for(run, lambda e: e["event"] == "rank_hello" and e["rank"] == 0, proc)
    wait_for(run, lambda e: e["event"] == "rank_hello" and e["rank"] == 1, proc)
    launch = next(e for e in events(run) if e["event"] == "launch")
    pids = [rank_pid(run, 0, 0), rank_pid(run, 1, 0), *launch["pids"]]
    procs = [psutil.Process(p) for p in pids]
    proc.kill()
    proc.communicate(timeout=30)
    _, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, f"survivors after the supervisor's SIGKILL: {alive}"


def test_dry_run_starts_nothing(tmp_path):
    proc = start(write_config(tmp_path), "--dry-run", "--set", "worker.train_iters=7")
    rc, out = finish(proc, 60)
    assert rc == 0, out
    assert "[worker]" in out and "train_iters = 7" in out
    assert "-m worker.template_client worker.train" in out and "--train-iters 7" in out
    assert not (tmp_path / "run").exists()

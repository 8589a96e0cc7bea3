"""End to end (issue 39 item 1): a job stopped with SIGINT part-way and continued with the one
command its supervisor printed resumes at the step it stopped at, finishes bit-exact against the
uninterrupted run, and `status` and the report show two supervisor lifetimes, each with its own
restart budget. Real supervisor, real mpiexec, the tiny model on 2 ranks."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import time

from tests.support import (
    REPO,
    TINY_JOB_WORKER,
    events,
    finish_supervisor,
    read_metrics,
    start_supervisor,
    supervisor_cli,
    supervisor_env,
    toml_table,
    worker_flags,
)

ITERS = 60
STOP_AT = 20  # the SIGINT once rank 0 has logged this step
WORKER = {**TINY_JOB_WORKER, "train_iters": ITERS, "save_interval": 10}
TIMEOUT = 240


def test_a_job_stopped_with_sigint_continues_bit_exact_with_the_command_it_printed(
    tmp_path, reference
):
    run = tmp_path / "run"
    text = toml_table("[job]", {"name": "c", "run_dir": str(run)})
    text += toml_table("[launch]", {"launcher": "mpiexec", "ranks_per_node": 2})
    text += toml_table("[worker]", WORKER)
    text += toml_table("[restart]", {"max_restarts": 3, "standby": False})
    (tmp_path / "job.toml").write_text(text)
    proc = start_supervisor(tmp_path / "job.toml")
    metrics = run / "attempts" / "000" / "metrics-0.jsonl"
    deadline = time.monotonic() + TIMEOUT
    while not [r for r in read_metrics(metrics) if r["step"] >= STOP_AT]:
        assert proc.poll() is None and time.monotonic() < deadline, "no step 20 to stop at"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    rc, out = finish_supervisor(proc, TIMEOUT)
    assert rc == 5, out[-3000:]
    stopped = next(e for e in events(run) if e["event"] == "attempt_end")
    assert stopped["outcome"] == "stopped" and stopped["max_step"] < ITERS
    step = stopped["max_step"]
    assert stopped["ckpt_complete"] == step  # the graceful stop saved where it was
    # The one command that continues it, and that nothing needs changing first.
    command = next(line for line in out.splitlines() if line.startswith("Continue: "))
    assert command == f"Continue: python -m supervisor run --resume {run}"
    first = out.splitlines()[out.splitlines().index(command) + 1]
    assert (
        first == f"  first: nothing needs to change: it resumes from its checkpoint at step {step}"
    )

    argv = shlex.split(command.removeprefix("Continue: "))
    assert argv[:3] == ["python", "-m", "supervisor"]
    again = subprocess.run(
        [sys.executable, *argv[1:]], cwd=REPO, env=supervisor_env(), capture_output=True,
        text=True, timeout=TIMEOUT,
    )  # fmt: skip
    out2 = again.stdout + again.stderr
    assert again.returncode == 0, out2[-3000:]
    assert f"continuing job {stopped and events(run)[0]['job']} in {run} (supervisor 2" in out2
    evs = events(run)
    starts = [e for e in evs if e["event"] == "start"]
    assert len(starts) == 2 and starts[0]["job"] == starts[1]["job"]
    assert [s["continues"] for s in starts] == [False, True]
    cut = evs.index(starts[1])
    resumed = next(e for e in evs[cut:] if e["event"] == "resumed")
    assert resumed["step"] == step and resumed["source"] in ("memory", "durable")
    assert resumed["attempt"] == 1  # attempt numbers go on
    done = next(e for e in evs[cut:] if e["event"] == "done")
    assert done["step"] == ITERS

    # Bit-exact: every step every attempt ran, against the uninterrupted run.
    want = reference(2, *worker_flags({**TINY_JOB_WORKER, "train_iters": ITERS}))
    seen = set()
    for attempt in (0, 1):
        for r in read_metrics(run / "attempts" / f"{attempt:03d}" / "metrics-0.jsonl"):
            assert r["loss"] == want[r["step"]], (attempt, r["step"])
            seen.add(r["step"])
    assert seen == set(range(1, ITERS + 1))

    # The summary is the second supervisor's; status and the report show both lifetimes.
    assert "Supervisor 2 of 2 in this run dir (continued at step" in out2
    assert "No failures." in out2 and "Continue:" not in out2
    status = supervisor_cli("status", str(run)).stdout
    assert "lifetimes: 2 supervisors ran this job" in status
    assert "attempts: 1   restarts: 0 of 3 (left 3)" in status
    assert f"stopped by SIGINT at step {step} (checkpoint {step})" in status
    assert "finished: DONE" in status
    report = (run / "report.md").read_text()
    assert "## Supervisor lifetimes" in report
    assert f"| INTERRUPTED: stopped by SIGINT at step {step} (checkpoint {step}) |" in report
    assert "| 0 of 3 restarts |" in report


def test_a_job_whose_supervisor_was_killed_continues_from_the_memory_copies_it_left(
    tmp_path, reference, mem_root
):
    """A SIGKILL of the supervisor takes its ranks with it but leaves the job's memory
    directory; `run --resume` is the same job (its id), holds that directory before the start's
    sweep, and its ranks resume from a copy newer than the newest durable checkpoint."""
    run = tmp_path / "run"
    worker = {**WORKER, "mem_ckpt_interval": 1}
    text = toml_table("[job]", {"name": "k", "run_dir": str(run)})
    text += toml_table("[launch]", {"launcher": "mpiexec", "ranks_per_node": 2})
    text += toml_table("[launch.env]", {"ES_MEM_ROOT": str(mem_root)})
    text += toml_table("[worker]", worker)
    text += toml_table("[restart]", {"max_restarts": 3, "standby": False})
    (tmp_path / "job.toml").write_text(text)
    env = {"ES_MEM_ROOT": str(mem_root)}
    proc = start_supervisor(tmp_path / "job.toml", extra_env=env)
    metrics = run / "attempts" / "000" / "metrics-0.jsonl"
    deadline = time.monotonic() + TIMEOUT
    while not [r for r in read_metrics(metrics) if r["step"] >= 25]:  # past the save at 20
        assert proc.poll() is None and time.monotonic() < deadline, "no step 25"
        time.sleep(0.02)
    proc.kill()
    proc.communicate(timeout=30)
    job = events(run)[0]["job"]
    assert (mem_root / f"es-mem-{job}").is_dir()  # left behind
    time.sleep(1.0)  # the ranks die with their parents (PDEATHSIG)
    again = subprocess.run(
        [sys.executable, "-m", "supervisor", "run", "--resume", str(run)], cwd=REPO,
        env={**supervisor_env(), **env}, capture_output=True, text=True, timeout=TIMEOUT,
    )  # fmt: skip
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert f"continuing job {job} in {run} (supervisor 2; the last ended: no final event" in out
    evs = events(run)
    cut = [i for i, e in enumerate(evs) if e["event"] == "start"][1]
    assert evs[cut]["job"] == job
    held = next(e for e in evs[cut:] if e["event"] == "mem_held")
    assert held["path"] == str(mem_root / f"es-mem-{job}")
    swept = [p for e in evs[cut:] if e["event"] == "mem_sweep" for p in e["paths"]]
    assert held["path"] not in swept
    resumed = next(e for e in evs[cut:] if e["event"] == "resumed")
    assert resumed["source"] == "memory" and resumed["step"] > 20, resumed
    want = reference(2, *worker_flags({**TINY_JOB_WORKER, "train_iters": ITERS}))
    seen = set()
    for adir in sorted((run / "attempts").iterdir()):
        for r in read_metrics(adir / "metrics-0.jsonl"):
            assert r["loss"] == want[r["step"]], (adir.name, r["step"])
            seen.add(r["step"])
    assert seen == set(range(1, ITERS + 1))
    assert "Supervisor 2 of 2 in this run dir (continued at step" in out
    assert "killed (no final event) at step" in out
    assert not (mem_root / f"es-mem-{job}").exists()  # the job's end removed it

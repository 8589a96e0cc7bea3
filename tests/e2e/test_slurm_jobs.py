"""Supervised jobs under Slurm's `srun` on real hosts: the test bed's Slurm cluster
(`testbed up N --slurm`: slurmctld on this machine, a slurmd in each host), the supervisor run
inside an allocation (`salloc --no-kill`, as a batch script's body would), `nodes = "auto"`
read from SLURM_JOB_NODELIST.

- A host killed mid-job (`testbed kill`: its slurmd, steps and ranks at once, its /dev/shm
  gone): found by its silence, checked out through srun, its rank resumed on the spare from its
  partner's copy through prepared ranks (steps of one node): at most a step lost, no durable
  read, bit-exact; after the job nothing of it on any host, no step of it left in Slurm.
- A kill of every rank: the warm standby (a step of its own beside the attempt's) resumes from
  the memory tier, bit-exact; a SIGTERM of the supervisor then stops the job with a checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import testbed
from tests.e2e.test_nodes_e2e import last_losses, of
from tests.e2e.test_testbed_jobs import PACE, PLAIN, left_on_hosts, wait_until, write_job
from tests.support import (
    REPO,
    events,
    finish_supervisor,
    read_metrics,
    supervisor_env,
    worker_flags,
)
from tests.testbed_support import bed_fixture, bed_module_fixture  # noqa: F401 (fixtures)

TESTBED_HOSTS = 4
TESTBED_SLURM = True
JOB_TIMEOUT = 300
ITERS = 120  # the SIGTERM test: far more steps than it runs before the SIGTERM
STEPD_GONE_S = 30  # Slurm ends a finished allocation's step daemons on its own


def srun_config(tmp_path: Path, faults: list[dict], worker: dict, spares: int = 0,
                restart: dict | None = None) -> Path:  # fmt: skip
    """A job of one rank per node of the allocation (`nodes = "auto"`), launched by srun."""
    launch = {"launcher": "srun", "nodes": "auto"}
    return write_job(tmp_path, "slurm", launch, faults, restart, worker, spares)


def start_in_allocation(bed: testbed.Bed, config: Path, nodes: int) -> subprocess.Popen:
    """`salloc --no-kill -N nodes python -m supervisor run CONFIG`: the allocation lives on when
    one of its nodes fails (without `--no-kill` Slurm ends the whole job with the node)."""
    argv = ["salloc", "--no-kill", f"--nodes={nodes}", "--verbose",
            sys.executable, "-m", "supervisor", "run", str(config)]  # fmt: skip
    env = {**supervisor_env(), **bed.slurm_env()}
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip


def slurm_left(bed: testbed.Bed) -> dict[str, list[str]]:
    """Slurm's view and the hosts': the steps `squeue` lists, each host's slurmstepd."""
    env = {**os.environ, **bed.slurm_env()}
    steps = subprocess.run(["squeue", "--steps", "--noheader", "--format=%i %j"], env=env,
                           capture_output=True, text=True, timeout=30).stdout  # fmt: skip
    out = {"steps": [s for s in steps.splitlines() if s.strip()]}
    for host in bed.hosts:
        if bed.state(host) != "up":
            continue
        got = bed.exec(host, ["pgrep", "-a", "slurmstepd"], capture_output=True, text=True,
                       timeout=30)  # fmt: skip
        out[host] = [line for line in got.stdout.splitlines() if line.strip()]
    return {k: v for k, v in out.items() if v}


def wait_in_allocation(bed: testbed.Bed, proc: subprocess.Popen, run: Path, what, timeout: float):
    """Until `what()`; the test fails at once if salloc or the supervisor ended first, and on
    either failure says what the supervisor printed and what Slurm saw (its nodes, its queue,
    the controller's last log lines): a job that never started is then explained."""
    if wait_until(lambda: what() or proc.poll() is not None, timeout) and what():
        return
    env = {**os.environ, **bed.slurm_env()}
    queue = subprocess.run(["squeue", "--all", "--noheader"], env=env, capture_output=True,
                           text=True, timeout=30).stdout  # fmt: skip
    log = testbed.slurm.SLURM_DIR / "slurmctld.log"
    tail = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
    nodes = testbed.slurm.node_states()
    children: list[psutil.Process] = []
    with contextlib.suppress(psutil.Error):  # the supervisor (salloc's child) holds the pipe
        children = psutil.Process(proc.pid).children()
    for child in children:
        child.send_signal(signal.SIGTERM)  # it stops its ranks and steps
    if not children and proc.poll() is None:  # salloc still waits for its allocation
        proc.kill()
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out = ""
    kept = [e for e in events(run) if e["event"].startswith(("prepared_", "standby_"))]
    pytest.fail(f"rc {proc.returncode}; events {events(run)[-5:]}\nkept {kept}\nnodes "
                f"{nodes}\nqueue {queue}\nslurmctld:\n"
                + "\n".join(tail) + f"\noutput:\n{(out or '')[-4000:]}")  # fmt: skip


def assert_nothing_left(bed: testbed.Bed, job: str) -> None:
    assert wait_until(lambda: not slurm_left(bed), STEPD_GONE_S), slurm_left(bed)
    for host, seen in left_on_hosts(bed, job).items():
        assert seen["procs"] == [], (host, seen)
        assert [n for n in seen["shm"] if job in n] == [], (host, seen)
        assert seen["stage"] == [], (host, seen)


def test_a_host_killed_under_srun_is_resumed_on_the_spare_from_its_partner(
    bed, tmp_path, reference
):
    """4 hosts (3 + 1 spare), 1 rank each, standby on, a memory copy every step, durable every
    20, all through srun: n1 killed. Its rank resumes on the spare n3 from n1's partner's copy,
    through prepared ranks started as one-node steps: at most a step lost, bit-exact."""
    want = reference(3, *worker_flags({**PLAIN, "train_iters": 60}))
    worker = {"train_iters": 60, "save_interval": 20, "async_ckpt": False}
    config = srun_config(tmp_path, [], worker, spares=1, restart={"exclude_after": 2})
    proc = start_in_allocation(bed, config, 4)
    run = tmp_path / "run"
    metrics = run / "attempts" / "000" / "metrics-0.jsonl"
    ready = lambda: any(e["event"] == "prepared_ready" for e in events(run))  # noqa: E731
    try:
        wait_in_allocation(bed, proc, run, lambda: metrics.exists()
                           and len(read_metrics(metrics)) >= 25 and ready(), 150)  # fmt: skip
        killed_at = max(r["step"] for r in read_metrics(metrics))
        bed.kill("n1")
        rc, out = finish_supervisor(proc, JOB_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, out[-6000:]
    evs = events(run)
    assert of(evs, "launch")[0]["nodes"] == ["n0", "n1", "n2"], of(evs, "launch")
    assert any(e["node"] == "n1" for e in of(evs, "node_excluded")), of(evs, "node_excluded")
    relaunch = of(evs, "relaunch")[0]
    kept = [e for e in evs if e["event"].startswith(("prepared_", "template_", "standby_"))]
    assert relaunch["mode"] == "prepared", f"{relaunch}\n{kept}"  # one-node steps on the spare
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == relaunch["attempt"]]
    assert {e["source"] for e in resumed} <= {"memory", "partner"}, resumed  # no durable read
    assert "partner" in {e["source"] for e in resumed}, resumed  # n1's state, from n2's copy
    assert resumed[0]["step"] >= killed_at - 1, (resumed, killed_at)
    assert last_losses(run) == want  # bit for bit, every step
    job = of(evs, "start")[0]["job"]
    bed.heal("n1")
    assert_nothing_left(bed, job)


@pytest.mark.slow
def test_srun_standby_resumes_from_memory_and_a_sigterm_stops_with_a_checkpoint(
    bed, tmp_path, reference
):
    """3 hosts through srun: a kill of every rank at step 13 (the standby ready: paced), the
    standby's step takes over from the memory tier, bit-exact; then a SIGTERM of the supervisor
    stops the job with a checkpoint of the step reached, and nothing is left."""
    want = reference(3, *worker_flags({**PLAIN, "train_iters": ITERS}))
    kill = {"name": "kill-all", "at_step": 13, "action": "kill"}
    config = srun_config(tmp_path, [PACE, kill], {"train_iters": ITERS, "save_interval": 20})
    proc = start_in_allocation(bed, config, 3)
    run = tmp_path / "run"
    warm = run / "attempts" / "001" / "metrics-0.jsonl"
    try:
        # the SIGTERM once the warm attempt has stepped a few steps: far from its last (it runs
        # at full speed, ~40 ms a step: a fixed sleep let it finish first on a fast host)
        wait_in_allocation(bed, proc, run, lambda: any(e["event"] == "relaunch"
                           for e in events(run)) and warm.exists() and len(read_metrics(warm)) >= 3,
                           150)  # fmt: skip
        (supervisor,) = psutil.Process(proc.pid).children()  # salloc's command
        supervisor.send_signal(signal.SIGTERM)
        rc, out = finish_supervisor(proc, JOB_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    evs = events(run)
    (relaunch,) = of(evs, "relaunch")
    assert relaunch["mode"] == "warm", relaunch  # the standby: a step beside the attempt's
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == relaunch["attempt"]]
    assert resumed and resumed[0]["source"] == "memory", (resumed, relaunch)
    got = last_losses(run)
    assert 13 < max(got) < ITERS and got == {s: want[s] for s in got}  # stopped, each step exact
    exit_ = of(evs, "supervisor_exit")[-1]
    assert exit_["code_name"] == "INTERRUPTED", (exit_, out[-3000:])
    stop_step = max(got)
    assert any(e["step"] == stop_step for e in of(evs, "ckpt_complete")), stop_step  # saved
    assert_nothing_left(bed, of(evs, "start")[0]["job"])

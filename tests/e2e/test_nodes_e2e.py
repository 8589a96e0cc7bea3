"""End to end on emulated nodes (issue 18): Hydra's fork launcher runs every named node's ranks
here, each name with its own proxy, and the supervisor treats each name as a node. Real ranks,
real mpiexec, real SIGKILLs.

- 4 nodes x 1 rank with 1 spare: node 1 killed twice -> n1 excluded, the spare n3 in its place,
  the job finishes, every loss equal to the uninterrupted run's;
- 3 nodes, no spare, shrink, excluded after one failure: n1 killed once and excluded, the job
  finishes on 2 nodes from a resharded checkpoint with the same global batch;
- 2 nodes, min_nodes 2, excluded after one failure: rank 1 killed from outside (no fault
  schedule: the failure is laid on its node from the processes alone) -> the job ends with
  exit 6 and says why;
- a node that fails the pre-launch check is out before the first launch, a spare in its place.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from contracts.exit_codes import ExitCode
from tests.support import (
    TINY_JOB_WORKER,
    events,
    finish_supervisor,
    inject_env,
    read_metrics,
    run_supervisor,
    start_supervisor,
    toml_table,
    worker_flags,
)

JOB_TIMEOUT = 300
WORKER = {**TINY_JOB_WORKER, "train_iters": 24, "save_interval": 4}
KILL_NODE_1 = {
    "name": "kill-node1",
    "at_step": [6, 14],
    "after_checkpoint": True,
    "action": "kill",
    "target": "node:1",
}


def job_config(
    tmp_path: Path, launch: dict, restart: dict, faults: list[dict], worker: dict = WORKER
) -> Path:
    text = toml_table("[job]", {"name": "nodes", "run_dir": str(tmp_path / "run")})
    launch = dict(launch)
    env = {"OMP_NUM_THREADS": "1", **launch.pop("env", {})}
    text += toml_table(
        "[launch]",
        {"launcher": "mpiexec", "emulate_nodes": True, "ranks_per_node": 1, **launch},
    )
    text += toml_table("[launch.env]", env)
    text += toml_table("[worker]", worker)
    text += toml_table("[restart]", {"backoff_s": [0], "standby": False, **restart})
    text += toml_table("[heartbeat]", {"interval_s": 0.25, "timeout_s": 4.0})
    for fault in faults:
        text += toml_table("[[faults]]", fault)
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def last_losses(run: Path) -> dict[int, float]:
    """step -> rank 0's loss, the newest attempt's record of a step winning."""
    out: dict[int, float] = {}
    for adir in sorted((run / "attempts").iterdir()):
        for r in read_metrics(adir / "metrics-0.jsonl"):
            out[r["step"]] = r["loss"]
    return out


def of(evs: list[dict], name: str) -> list[dict]:
    return [e for e in evs if e["event"] == name]


def test_a_node_that_keeps_failing_is_swapped_for_the_spare_and_the_run_is_the_same(
    tmp_path, reference
):
    want = reference(3, *worker_flags({k: v for k, v in WORKER.items() if k != "save_interval"}))

    launch = {"nodes": ["n0", "n1", "n2", "n3"], "spares": 1}
    rc, out = run_supervisor(job_config(tmp_path, launch, {}, [KILL_NODE_1]), JOB_TIMEOUT)
    assert rc == 0, out
    run = tmp_path / "run"
    evs = events(run)
    ends = [e for e in of(evs, "attempt_end") if e["outcome"] == "failure"]
    assert [e["node"] for e in ends] == ["n1", "n1"]
    assert all(e["attributed"]["ranks"] == [1] for e in ends)
    (excluded,) = of(evs, "node_excluded")
    assert (excluded["node"], excluded["count"]) == ("n1", 2)
    (swapped,) = of(evs, "node_swapped")
    assert (swapped["out"], swapped["into"]) == ("n1", "n3")
    launches = of(evs, "launch")
    assert [e["nodes"] for e in launches] == [["n0", "n1", "n2"]] * 2 + [["n0", "n3", "n2"]]
    assert (run / "hostfile").read_text().split() == ["n0", "n3", "n2"]
    assert not of(evs, "shrink")
    assert last_losses(run) == want  # bit for bit, every step


@pytest.mark.slow
def test_without_a_spare_the_job_shrinks_and_finishes_on_two_nodes(tmp_path):
    launch = {"nodes": ["n0", "n1", "n2"]}
    restart = {"shrink": True, "min_nodes": 2, "exclude_after": 1}  # (2: the test above)
    once = {**KILL_NODE_1, "at_step": [6]}
    rc, out = run_supervisor(job_config(tmp_path, launch, restart, [once]), JOB_TIMEOUT)
    assert rc == 0, out
    run = tmp_path / "run"
    evs = events(run)
    (excluded,) = of(evs, "node_excluded")
    assert excluded["node"] == "n1"
    (shrink,) = of(evs, "shrink")
    assert shrink["nodes"] == ["n0", "n2"] and shrink["world"] == [3, 2]
    assert shrink["flags"] == {"batch_size": 3} and shrink["batch_kept"] is True
    last = of(evs, "launch")[-1]
    assert (last["nodes"], last["world"]) == (["n0", "n2"], 2)
    command = (run / "attempts" / f"{last['attempt']:03d}" / "command.txt").read_text()
    assert "--batch-size 3" in command
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == last["attempt"]]
    assert resumed and resumed[0]["step"] >= 8  # the 3-rank checkpoint, resharded
    done = of(evs, "done")[0]
    assert done["step"] == WORKER["train_iters"]
    losses = last_losses(run)
    assert sorted(losses) == list(range(1, WORKER["train_iters"] + 1))


@pytest.mark.slow
def test_below_min_nodes_the_job_ends_with_its_own_exit_code(tmp_path):
    """No fault schedule: rank 1 is SIGKILLed from outside, and the supervisor lays it on n1
    from what it sees of the processes (the first to end); one failure excludes a node here."""
    launch = {"nodes": ["n0", "n1"]}
    restart = {"shrink": True, "min_nodes": 2, "exclude_after": 1}
    proc = start_supervisor(job_config(tmp_path, launch, restart, []))
    run = tmp_path / "run"
    try:
        pid = wait_rank_training(run, 0, rank=1, proc=proc)
        os.kill(pid, signal.SIGKILL)
        rc, out = finish_supervisor(proc, JOB_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == ExitCode.NODES, out
    evs = events(run)
    ends = [e for e in of(evs, "attempt_end") if e["outcome"] == "failure"]
    assert [e["node"] for e in ends] == ["n1"], [e.get("attributed") for e in ends]
    (give_up,) = of(evs, "give_up")
    assert give_up["code_name"] == "NODES"
    assert "min_nodes = 2" in give_up["reason"]
    assert "min_nodes = 2" in out and "Traceback" not in out


@pytest.mark.slow
def test_a_node_that_fails_the_pre_launch_check_never_runs_a_rank(tmp_path):
    launch = {
        "nodes": ["n0", "n1", "n2", "n3"],
        "spares": 1,
        "env": inject_env(node_check_fail=["n2"]),
    }
    short = {**WORKER, "train_iters": 4}
    rc, out = run_supervisor(job_config(tmp_path, launch, {}, [], short), JOB_TIMEOUT)
    assert rc == 0, out
    evs = events(tmp_path / "run")
    (check,) = of(evs, "node_check")
    assert check["reported"] == 4 and list(check["failed"]) == ["n2"]
    (excluded,) = of(evs, "node_excluded")
    assert excluded["node"] == "n2" and "pre-launch check" in excluded["reason"]
    assert [e["nodes"] for e in of(evs, "launch")] == [["n0", "n1", "n3"]]


def wait_rank_training(run: Path, attempt: int, rank: int, proc, timeout: float = 120) -> int:
    """The pid of `rank` of `attempt` once that attempt has a complete checkpoint (a kill
    before it would resume from the same step again)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        evs = events(run) if (run / "events.jsonl").exists() else []
        ckpt = [e for e in evs if e["event"] == "ckpt_complete" and e["attempt"] == attempt]
        hello = [e for e in evs if e["event"] == "rank_hello" and e["attempt"] == attempt]
        pids = [e["pid"] for e in hello if e["rank"] == rank]
        if ckpt and pids:
            return pids[0]
        time.sleep(0.1)
    pytest.fail(f"attempt {attempt} made no checkpoint in {timeout} s")

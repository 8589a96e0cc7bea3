"""A node lost for good, on emulated nodes (real mpiexec, real SIGKILLs): 3 nodes x 1 rank and 1
spare, durable saves and the memory tier. A `node_loss` of node 1 kills its rank and takes its
memory root away; the node check before the relaunch finds it down and the spare takes its place
at once (exclude_after is 2); no step is held by every rank in memory any more (the lost node's
copies are gone), so the job resumes from durable, and every loss equals the uninterrupted run's.
With a standby, its rank on the lost node dies too and the relaunch onto the spare is cold.
"""

from __future__ import annotations

import pytest

from contracts.env_names import ENV_MEM_ROOT
from tests.e2e.test_nodes_e2e import JOB_TIMEOUT, WORKER, job_config, last_losses, of
from tests.support import events, run_supervisor, worker_flags

NODE_LOSS = {
    "name": "lose-node1",
    "at_step": 6,
    "after_checkpoint": True,
    "action": "node_loss",
    "target": "node:1",
}


@pytest.mark.slow
@pytest.mark.parametrize("standby", [False, True])
def test_a_lost_node_is_swapped_for_the_spare_at_once_and_the_run_is_the_same(
    tmp_path, reference, standby
):
    plain = {k: v for k, v in WORKER.items() if k != "save_interval"}
    want = reference(3, *worker_flags(plain))

    mem = tmp_path / "mem"
    launch = {"nodes": ["n0", "n1", "n2", "n3"], "spares": 1, "env": {ENV_MEM_ROOT: str(mem)}}
    worker = {**WORKER, "mem_ckpt_interval": 1}
    restart = {"exclude_after": 2, "standby": standby}
    config = job_config(tmp_path, launch, restart, [NODE_LOSS], worker)
    rc, out = run_supervisor(config, JOB_TIMEOUT)
    assert rc == 0, out
    run = tmp_path / "run"
    evs = events(run)
    (fault,) = of(evs, "fault")
    assert (fault["action"], fault["node"], fault["ranks"]) == ("node_loss", "n1", [1])
    assert fault["mem_root_removed"] == str(mem / "n1")
    if standby:  # its standby rank on n1 died with it; the relaunch is cold, onto the spare
        assert len(fault["standby_pids"]) <= 1
        (relaunch,) = of(evs, "relaunch")
        assert relaunch["mode"] == "cold", relaunch
    held = sorted(e["path"] for e in of(evs, "mem_held"))
    assert [p.split("/")[-2] for p in held] == ["n0", "n1", "n2", "n3"]  # one root per node
    checks = of(evs, "node_check")
    assert len(checks) >= 2 and list(checks[-1]["failed"]) == ["n1"], (checks, out[-4000:])
    (excluded,) = of(evs, "node_excluded")
    assert excluded["node"] == "n1" and excluded["count"] == 1
    assert excluded["reason"].startswith("node check before relaunch: no report")
    (swapped,) = of(evs, "node_swapped")
    assert (swapped["out"], swapped["into"]) == ("n1", "n3")
    assert [e["nodes"] for e in of(evs, "launch")] == [["n0", "n1", "n2"], ["n0", "n3", "n2"]]
    last = of(evs, "launch")[-1]["attempt"]
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == last]
    assert resumed and {e.get("source") for e in resumed} == {"durable"}
    assert last_losses(run) == want  # bit for bit, every step
    assert not (mem / "n1").exists()  # the lost node's memory is gone for good
    assert not [p for p in mem.rglob("es-mem-*")]  # the others' removed when the job ended

"""A node lost for good, on emulated nodes (real mpiexec, real SIGKILLs, real sockets): each
rank's memory copies are also held by its partner, the rank of the next node.

- 3 nodes x 1 rank and 1 spare: a `node_loss` of node 1 between two durable saves kills its
  rank and takes its memory root away; the node check before the relaunch finds it down and the
  spare takes its place at once (exclude_after is 2). The spare's rank takes its copy from its
  partner (rank 2), the others from their own memory: resumed from `partner`, at most one step
  lost, every loss equal to the uninterrupted run's. The job keeps a standby: its rank on the
  lost node dies too, and the relaunch onto the spare is cold and says why.
- The partner's copies damaged in its memory: refused at the fetch, the resume is durable.
- Two neighbouring nodes of 3 lost at once: rank 1's own copies and those its partner held are
  both gone, no step is common, the resume is durable.
"""

from __future__ import annotations

import pytest

from contracts.env_names import ENV_MEM_ROOT
from tests.e2e.test_nodes_e2e import JOB_TIMEOUT, WORKER, job_config, last_losses, of
from tests.support import events, inject_env, run_supervisor, worker_flags

NODE_LOSS = {"name": "lose-node1", "at_step": 13, "action": "node_loss", "target": "node:1"}
# Durable saves at 10 and 20, a memory copy every step: the loss at 13 lies between two saves.
PARTNERED = {**WORKER, "save_interval": 10, "mem_ckpt_interval": 1}
PLAIN = {k: v for k, v in WORKER.items() if k != "save_interval"}  # the uninterrupted run


def lose_nodes(tmp_path, nodes: int, spares: int, fault: dict, restart=None, env=None):
    """Run the job on `nodes` emulated nodes (+ `spares`) with one node loss: (events, run dir,
    memory root)."""
    mem = tmp_path / "mem"
    names = [f"n{i}" for i in range(nodes + spares)]
    launch = {"nodes": names, "spares": spares, "env": {ENV_MEM_ROOT: str(mem), **(env or {})}}
    restart = {"exclude_after": 2, **(restart or {})}
    config = job_config(tmp_path, launch, restart, [fault], PARTNERED)
    rc, out = run_supervisor(config, JOB_TIMEOUT)
    assert rc == 0, out
    run = tmp_path / "run"
    return events(run), run, mem, out


def last_resume(evs: list[dict]) -> dict:
    last = of(evs, "launch")[-1]["attempt"]
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == last]  # the first rank's word
    assert resumed, evs
    return resumed[0]


# With the standby: every step stretched (0.4 s) and the node lost at step 45, so that the
# standby (about 8 s here) and then the prepared ranks (imports on 4 nodes) are ready by then.
SLOW_ALL = {"name": "stretch", "at_step": 1, "action": "slow", "target": "all",
            "delay_s": 0.4, "duration_s": 120}  # fmt: skip
LATE_LOSS = {**NODE_LOSS, "at_step": 45}
LONGER = {**PARTNERED, "train_iters": 50}


@pytest.mark.slow
def test_a_lost_node_s_ranks_resume_from_their_partners_on_the_spare(tmp_path, reference):
    """With a standby and prepared ranks (the one test of both): the standby's rank on the
    lost node dies with it, and the relaunch starts the prepared ranks of n0, n2 and the spare
    n3 as its ranks (no cold processes); the spare's rank resumes from its partner."""
    want = reference(3, *worker_flags({**PLAIN, "train_iters": 50}))
    mem = tmp_path / "mem"
    names = ["n0", "n1", "n2", "n3"]
    launch = {"nodes": names, "spares": 1, "env": {ENV_MEM_ROOT: str(mem)}}
    restart = {"exclude_after": 2, "standby": True}
    config = job_config(tmp_path, launch, restart, [SLOW_ALL, LATE_LOSS], LONGER)
    rc, out = run_supervisor(config, JOB_TIMEOUT)
    assert rc == 0, out
    run = tmp_path / "run"
    evs = events(run)
    fault = next(f for f in of(evs, "fault") if f["action"] == "node_loss")
    assert (fault["node"], fault["ranks"]) == ("n1", [1])
    assert fault["mem_root_removed"] == str(mem / "n1")
    before = evs[: evs.index(fault)]
    (prepared,) = of(before, "prepared_launch")  # once the standby was ready
    assert prepared["nodes"] == names
    assert of(before, "prepared_ready"), out[-4000:]
    assert len(fault["standby_pids"]) == 2  # the standby's rank and the prepared rank on n1
    (relaunch,) = of(evs, "relaunch")
    assert relaunch["mode"] == "prepared", relaunch
    assert relaunch["standby_unused"].startswith("the standby ended with the failed node n1")
    (lost,) = of(evs, "prepared_lost")  # n1's, killed with its node
    assert lost["node"] == "n1" and "cold_because" not in relaunch
    launches = of(evs, "launch")
    assert [e["nodes"] for e in launches] == [["n0", "n1", "n2"], ["n0", "n3", "n2"]]
    assert launches[-1]["prepared"] == prepared["attempt"]
    # n1's launch ended with its node (the next prepared ranks, ready before the job's end when
    # the relaunch is quick, end "job over")
    (ended,) = [e for e in of(evs, "prepared_exit") if e["reason"] != "job over"]
    assert ended["node"] == "n1" and ended["reason"] == "not taken"
    checks = of(evs, "node_check")
    assert len(checks) >= 2 and list(checks[-1]["failed"]) == ["n1"], (checks, out[-4000:])
    (swapped,) = of(evs, "node_swapped")
    assert (swapped["out"], swapped["into"]) == ("n1", "n3")
    resumed = last_resume(evs)
    assert resumed["source"] == "partner", (resumed, out[-4000:])
    assert max(fault["steps"]) - resumed["step"] <= 2  # not durable
    assert last_losses(run) == want  # bit for bit, every step
    held = sorted(e["path"] for e in of(evs, "mem_held"))
    assert [p.split("/")[-2] for p in held] == ["n0", "n1", "n2", "n3"]  # one root per node
    assert not (mem / "n1").exists()  # the lost node's memory is gone for good
    assert not [p for p in mem.rglob("es-mem-*")]  # the others' removed when the job ended


@pytest.mark.slow
def test_a_damaged_partner_copy_is_refused_and_the_resume_is_durable(tmp_path, reference):
    """Rank 2 holds rank 1's copies, each with a byte flipped once sealed; node 1 lost: the
    fetch refuses the copy, its holder forgets it, and every rank loads durable step 10."""
    want = reference(3, *worker_flags(PLAIN))
    damage = inject_env(rank=2, damage_partner_copies_at_step=1)
    evs, run, _, out = lose_nodes(tmp_path, 3, 1, NODE_LOSS, env=damage)
    resumed = last_resume(evs)
    assert (resumed["source"], resumed["step"]) == ("durable", 10), (resumed, out[-4000:])
    assert "rank 1: the copy of step" in resumed["why"] and "fail their checksum" in resumed["why"]
    assert last_losses(run) == want


@pytest.mark.slow
def test_two_neighbouring_nodes_lost_leave_no_common_step(tmp_path, reference):
    """Nodes 1 and 2 of 3 lost at once: rank 1's own copies and the ones rank 2 held of it are
    gone (rank 2's own are held by rank 0), so no step is held by every rank; both spares come
    in, the resume is durable."""
    want = reference(3, *worker_flags(PLAIN))
    lose_two = {**NODE_LOSS, "name": "lose-nodes-1-2", "target": "node:1-2"}
    evs, run, mem, out = lose_nodes(tmp_path, 3, 2, lose_two)
    (fault,) = of(evs, "fault")
    assert (fault["node"], fault["ranks"]) == (["n1", "n2"], [1, 2])
    assert [e["nodes"] for e in of(evs, "launch")][-1] == ["n0", "n3", "n4"]
    resumed = last_resume(evs)
    assert (resumed["source"], resumed["step"]) == ("durable", 10), (resumed, out[-4000:])
    assert last_losses(run) == want

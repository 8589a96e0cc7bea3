"""A straggler found and replaced, end to end on emulated nodes (real mpiexec, real ranks, real
collectives): 3 nodes x 1 rank and a spare; a `slow` fault makes rank 2 (node n2) sleep about
half a step in every step. Its compute goes up, the others' wait goes up: the `straggler` event
names rank 2 and n2 within 30 steps of the fault; with `action = "replace"` the ranks stop
gracefully at the next durable checkpoint, the spare n3 takes n2's place, and the job finishes
there with every loss equal to the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import pytest

from tests.e2e.test_nodes_e2e import JOB_TIMEOUT, WORKER, job_config, last_losses, of
from tests.support import events, run_supervisor, worker_flags

SLOW_AT = 3
# Half a step or more: a step of the tiny model takes ~0.2-0.4 s with 3-4 ranks on 2 busy cores.
SLOW = {
    "name": "slow-rank2",
    "at_step": SLOW_AT,
    "action": "slow",
    "target": "rank:2",
    "delay_s": 0.2,
    "duration_s": 600,
}
STRAGGLING = WORKER  # 24 steps, a durable save every 4
# The uninterrupted run: the flags of test_node_loss's and test_nodes_e2e's (run once for all).
PLAIN = {k: v for k, v in WORKER.items() if k != "save_interval"}


@pytest.mark.slow
def test_a_slow_rank_is_named_and_its_node_replaced_by_the_spare(tmp_path, reference):
    want = reference(3, *worker_flags(PLAIN))
    names = [f"n{i}" for i in range(4)]
    config = job_config(tmp_path, {"nodes": names, "spares": 1}, {}, [SLOW], STRAGGLING)
    with config.open("a") as f:
        f.write('\n[stragglers]\naction = "replace"\n')
    rc, out = run_supervisor(config, JOB_TIMEOUT)
    assert rc == 0, out[-4000:]
    run = tmp_path / "run"
    evs = events(run)
    (fault,) = of(evs, "fault")
    found = of(evs, "straggler")
    assert found, out[-4000:]
    first = found[0]
    assert (first["ranks"], first["node"], first["action"]) == ([2], "n2", "replace"), found
    assert first["step"] - fault["step"] <= 30 and first["score"] > 1.6, (first, fault)
    assert [e for e in of(evs, "stop") if e.get("reason") == "straggler"], out[-4000:]
    (excluded,) = of(evs, "node_excluded")
    assert excluded["node"] == "n2" and excluded["reason"].startswith("straggler: rank(s) 2")
    (swapped,) = of(evs, "node_swapped")
    assert (swapped["out"], swapped["into"]) == ("n2", "n3")
    (relaunch,) = of(evs, "relaunch")
    assert relaunch["reason"].startswith("straggler on n2 replaced"), relaunch
    launches = [e["nodes"] for e in of(evs, "launch")]
    assert launches == [names[:3], ["n0", "n1", "n3"]], launches
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == of(evs, "launch")[-1]["attempt"]]
    assert resumed and resumed[0]["step"] > first["step"], (resumed, first)
    assert of(evs, "done"), out[-4000:]
    assert last_losses(run) == want  # bit for bit, every step

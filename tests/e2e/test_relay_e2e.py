"""End to end through per-node relays (issue 19): 2 real hosts of the test bed x 2 ranks (Hydra
over `testbed/ssh`), `[heartbeat] relay = true`: local rank 0 of each host relays its host's
beats (over an abstract Unix socket of that host's own network) as one summary per interval,
from the host's own address. Real ranks, real mpiexec, real SIGSTOPs.

- attempt 0: rank 1 (n0's member, not a relay) is stopped -> a `hang` naming rank 1 alone;
- attempt 1: rank 2 (n1's relay) is stopped -> a `hang` of its node: ranks 2 and 3, node n1,
  the relay named in the reason (one failure per node: none is excluded);
- attempt 2 finishes; no other finding, every rank said hello, and no rank's own beat reached the
  supervisor (only summaries).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import testbed
from tests.support import TINY_JOB_WORKER, events, run_supervisor, toml_table
from tests.testbed_support import bed_fixture, bed_module_fixture  # noqa: F401 (fixtures)

JOB_TIMEOUT = 300
WORKER = {**TINY_JOB_WORKER, "train_iters": 20, "save_interval": 4}

pytestmark = pytest.mark.slow
TESTBED_HOSTS = 2


def job_config(tmp_path: Path, bed: testbed.Bed) -> Path:
    text = toml_table("[job]", {"name": "relay", "run_dir": str(tmp_path / "run")})
    text += toml_table(
        "[launch]",
        {"launcher": "mpiexec", "flavor": "hydra", "nodes": bed.hosts, "ranks_per_node": 2,
         "args": bed.launcher_args()},
    )  # fmt: skip
    text += toml_table("[launch.env]", {"OMP_NUM_THREADS": "1"})
    text += toml_table("[worker]", WORKER)
    # A stopped rank ignores the teardown's SIGTERM: 1 s (not 3) before its SIGKILL.
    restart = {"backoff_s": [0], "standby": False, "max_restarts": 4, "teardown_grace_s": 1.0}
    text += toml_table("[restart]", restart)
    # 4 s: on a loaded 2-core host a starting rank's beats (a relay's summaries) can pause for
    # 2-3 s while its imports hold the interpreter; with 2 s each such pause was a false hang.
    text += toml_table("[heartbeat]", {"interval_s": 0.25, "timeout_s": 4.0, "relay": True})
    for name, step, rank in (("stop-member", 6, 1), ("stop-relay", 10, 2)):
        fault = {"name": name, "at_step": step, "action": "hang", "target": f"rank:{rank}"}
        text += toml_table("[[faults]]", fault)
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_relayed_ranks_a_stopped_member_is_named_a_stopped_relay_is_its_node(bed, tmp_path):
    code, out = run_supervisor(job_config(tmp_path, bed), JOB_TIMEOUT)
    evs = events(tmp_path / "run")
    assert code == 0, out[-4000:]
    hangs = [e for e in evs if e["event"] == "hang"]
    others = [e for e in evs if e["event"] in ("no_progress", "rank_exit")]
    assert not others, others
    assert len(hangs) == 2, (hangs, out[-3000:])
    member, relay = hangs
    assert member["ranks"] == [1] and "node" not in member, member
    assert relay["ranks"] == [2, 3] and relay["node"] == "n1", relay
    assert "relay of node n1 (rank 2)" in relay["reason"], relay
    for h in hangs:  # found within the liveness timeout's check, not seconds late
        assert h["latency_s"] < 1.5, h
    hellos = {(e["attempt"], e["rank"]) for e in evs if e["event"] == "rank_hello"}
    assert {(a, r) for a in (0, 1, 2) for r in range(4)} <= hellos
    assert any(e["event"] == "done" for e in evs)
    command = (tmp_path / "run" / "attempts" / "000" / "command.txt").read_text()
    assert "ES_HEARTBEAT_RELAY" in command, command

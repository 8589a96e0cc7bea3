"""End to end: checkpoint intervals that tune themselves, under a failure rate that changes.

The real supervisor, real mpiexec, 2 ranks of the tiny model, both tiers "auto" (the memory tier's
default, and `save_interval = "auto"`), a prior MTBF of a minute. Rank 1 is killed four times
close together early on, then the job runs quiet for most of its steps and is killed once more
near the end. The durable interval, long by the prior, shortens as the failures come and
lengthens again through the quiet spell; the MTBF estimate behind it falls and rises; both ranks
switch at the same steps; and every step every attempt ran has the uninterrupted run's loss.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.support import (
    TINY_JOB_WORKER,
    events,
    read_metrics,
    run_supervisor,
    toml_table,
    worker_flags,
)

pytestmark = pytest.mark.slow

TRAIN_ITERS = 450
WORKER = {**TINY_JOB_WORKER, "train_iters": TRAIN_ITERS}
DENSE = [20, 35, 50, 65]  # four kills a few seconds apart (each relaunch is warm: ~0.3 s)
SPARSE = [420]  # then one, after some 350 quiet steps
PRIOR_S = 60.0


def write_config(tmp_path: Path) -> Path:
    worker = {**WORKER, "save_interval": "auto", "mem_ckpt_interval": "auto",
              "mtbf_prior_s": PRIOR_S, "metrics_all_ranks": True, "log_every": 50}  # fmt: skip
    text = toml_table("[job]", {"name": "auto", "run_dir": str(tmp_path / "run")})
    text += toml_table("[launch]", {"launcher": "mpiexec", "ranks_per_node": 2})
    text += toml_table("[launch.env]", {"OMP_NUM_THREADS": "1"})
    text += toml_table("[worker]", worker)
    text += toml_table("[restart]", {"max_restarts": 8, "teardown_grace_s": 1.0, "backoff_s": [0]})
    text += toml_table("[heartbeat]", {"interval_s": 0.25, "timeout_s": 3.0})
    for steps in (DENSE, SPARSE):
        text += toml_table("[[faults]]", {"at_step": steps, "action": "kill", "target": "rank:1"})
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_the_intervals_follow_a_failure_rate_that_changes(tmp_path, reference):
    want = reference(2, *worker_flags(WORKER))
    rc, out = run_supervisor(write_config(tmp_path), 300)
    run = tmp_path / "run"
    assert rc == 0, out[-4000:]
    evs = events(run)
    ends = [e for e in evs if e["event"] == "attempt_end" and e["outcome"] == "failure"]
    assert len(ends) == len(DENSE) + len(SPARSE), out[-4000:]

    # Bit-exact: the intervals move copies and saves, never what a step computes.
    attempts = sorted(d for d in (run / "attempts").iterdir() if (d / "metrics-0.jsonl").exists())
    seen = set()
    for d in attempts:
        for r in read_metrics(d / "metrics-0.jsonl"):
            assert r["loss"] == want[r["step"]], (d.name, r["step"])
            seen.add(r["step"])
        # every rank switched at the same steps to the same intervals
        switches = [
            [(r["step"], r.get(k)) for r in read_metrics(d / f"metrics-{rank}.jsonl")
             for k in ("train/mem_ckpt_interval", "train/save_interval") if k in r]
            for rank in (0, 1)
        ]  # fmt: skip
        assert switches[0] == switches[1], d.name
    assert seen == set(range(1, TRAIN_ITERS + 1))

    changed = [e for e in evs if e["event"] == "interval_changed"]
    durable = [e for e in changed if e["tier"] == "durable"]
    print("durable:", [(e["why"], e["failures"], e["mtbf_s"], e["new"]) for e in durable])
    print("memory:", [(e["why"], e["failures"], e["mtbf_s"], e["new"]) for e in changed
                      if e["tier"] == "memory"])  # fmt: skip
    assert any(e["tier"] == "memory" for e in changed)
    for e in changed:  # the inputs are in the event
        assert e["cost_s"] >= 0 and e["step_s"] > 0 and e["prior_mtbf_s"] == PRIOR_S, e
    first = durable[0]
    dense = [e for e in durable if 1 <= e["failures"] <= len(DENSE)]
    quiet = [e for e in durable if e["failures"] == len(DENSE) and e["why"] == "cost"]
    assert first["failures"] == 0 or first["mtbf_s"] > 10, first  # the prior's, before failures
    assert dense and quiet, durable
    shortest = min(e["new"] for e in dense)
    assert shortest < first["new"] / 2, durable  # the dense failures shortened it
    # the quiet spell: the estimate rises without a failure, and the interval with it
    # (by how much is the host's pace: the spell is some 350 steps, 3-30 s of wall time, so one
    # change or several: each above the one before, the last above the failures' lowest)
    for prev, e in itertools.pairwise(quiet):
        assert e["mtbf_s"] > prev["mtbf_s"] and e["new"] > prev["new"], durable
    assert quiet[-1]["mtbf_s"] > min(e["mtbf_s"] for e in dense), durable
    assert quiet[-1]["new"] > shortest, durable
    # every decision reached the running attempt's rank 0 (or a standby waiting)
    assert all(e["to"] for e in changed if e["why"] == "cost"), changed

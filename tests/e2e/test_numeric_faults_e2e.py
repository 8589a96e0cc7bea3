"""The numerical guard under the supervisor, end to end (tiny model, 2 ranks, real mpiexec).

- A diverging run (a learning rate that blows the weights up): the guard gives up and the job
  ends at once, with exit DIVERGED and the guard's line in `supervisor_exit`, the summary,
  `status` and the report: no relaunch, no restart spent.
- Injected `nan` faults at consecutive steps: each point is one `fault` event, applied at its
  own step, and one `numeric_fault` at that step.
"""

from __future__ import annotations

from pathlib import Path

from contracts.exit_codes import ExitCode
from tests.support import (
    TINY_JOB_WORKER,
    events,
    run_supervisor,
    supervisor_cli,
    toml_table,
)

GAVE_UP = "the numerical guard gave up"


def job(tmp_path: Path, worker: dict, faults: list[dict] = (), **restart) -> tuple[Path, Path]:
    run = tmp_path / "run"
    text = toml_table("[job]", {"name": "g", "run_dir": str(run)})
    text += toml_table("[launch]", {"launcher": "mpiexec", "ranks_per_node": 2})
    text += toml_table("[launch.env]", {"OMP_NUM_THREADS": "1"})
    text += toml_table("[worker]", {**TINY_JOB_WORKER, **worker})
    text += toml_table("[restart]", {"standby": False, **restart})
    text += "".join(toml_table("[[faults]]", f) for f in faults)
    (tmp_path / "job.toml").write_text(text)
    return tmp_path / "job.toml", run


def test_a_diverging_run_ends_at_once_with_the_guards_line(tmp_path):
    """lr 3000: the weights are non-finite after step 1, every later step is bad, the guard
    gives up after 10 in a row. Before: exit 2 after a step was a failure, relaunched twice
    from step 0, then exit 4 "no progress", the guard's line nowhere in the end."""
    config, run = job(
        tmp_path,
        {"train_iters": 40, "lr": 3000.0, "warmup_iters": 5, "save_interval": 5,
         "mem_ckpt_interval": 0},
        max_restarts=3,
    )  # fmt: skip
    code, out = run_supervisor(config, 240)
    assert code == ExitCode.DIVERGED, out[-4000:]

    evs = events(run)
    assert [e for e in evs if e["event"] == "relaunch"] == []  # 0 relaunches
    (end,) = [e for e in evs if e["event"] == "attempt_end"]
    assert end["outcome"] == "diverged" and GAVE_UP in end["detail"], end
    (give_up,) = [e for e in evs if e["event"] == "give_up"]
    assert give_up["code_name"] == "DIVERGED" and GAVE_UP in give_up["reason"]
    (exit_ev,) = [e for e in evs if e["event"] == "supervisor_exit"]
    assert exit_ev["restarts"] == 0 and GAVE_UP in exit_ev["reason"]
    assert exit_ev["code"] == ExitCode.DIVERGED

    assert GAVE_UP in out  # the summary at the end
    status = supervisor_cli("status", str(run)).stdout
    assert "DIVERGED" in status and GAVE_UP in status and "restarts: 0 of 3" in status
    report = (run / "report.md").read_text()
    assert "DIVERGED" in report and GAVE_UP in report


def test_consecutive_nan_points_each_make_their_own_bad_step_at_their_step(tmp_path):
    """21 points, steps 5 to 25, on rank 1. Before: 21 `fault` events but 18-19 bad steps (two
    points sent while the rank was at one step landed in one step), each 2 steps after its
    point. Now each point is one `fault` event once the rank applied it, at that very step,
    and one `numeric_fault` there (or a `fault_undelivered` saying why not)."""
    points = list(range(5, 26))
    config, run = job(
        tmp_path,
        {"train_iters": 30, "save_interval": 0, "mem_ckpt_interval": 0},
        [{"name": "nans", "at_step": points, "action": "nan", "target": "rank:1"}],
    )
    code, out = run_supervisor(config, 240)
    assert code == 0, out[-4000:]

    evs = events(run)
    fired = [e for e in evs if e["event"] == "fault"]
    lost = [e for e in evs if e["event"] == "fault_undelivered"]
    bad = [e for e in evs if e["event"] == "numeric_fault"]
    assert lost == [], lost  # nothing held up on 2 cores: every point arrived in time
    assert [e["point"]["step"] for e in fired] == points
    assert [e["steps"] for e in fired] == [[p] for p in points]  # applied at its step
    assert [(e["step"], e["kind"], e["ranks"]) for e in bad] == [(p, "nan", [1]) for p in points]
    assert [e["attempt"] for e in evs if e["event"] == "launch"] == [0]
    (summary,) = [e for e in evs if e["event"] == "fault_summary"]
    assert summary["total"] == len(points)

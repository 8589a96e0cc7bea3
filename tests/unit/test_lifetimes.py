"""Every reader tells the supervisor lifetimes of a run dir apart (issue 40 items 5-8): the
summary, `status`, `tail` and `report` over hand-made run dirs: a supervisor SIGKILLed and a
second `run` on the same dir, a finished job run again, a standby that never trained, a node
loss, a graceful stop, a job stopped for want of nodes, and the saves no later step timed."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.commands import cli
from supervisor.commands.status import status_lines
from supervisor.policy.nodes import NodePool
from supervisor.reporting.analysis import analyze
from supervisor.reporting.load import load_run
from supervisor.reporting.plot import lifetime_marks, plot
from supervisor.reporting.report_md import render
from supervisor.reporting.summary import summary
from tests.support import T0, ev, rec, write_run

MEM = {"train/mem_ckpt_stall_seconds": 0.01, "train/mem_ckpt_copy_seconds": 0.02}


def killed_then_run_again() -> tuple[list[dict], dict[int, list]]:
    """Supervisor 1 (job A): attempt 0 killed by a fault at 25, attempt 1 resumed from 20 and
    reached 34 when the supervisor was SIGKILLed (no final event). Supervisor 2 (job B) on the
    same dir: attempt 2 resumed from 30, hung at 45, attempt 3 finished at 60."""
    nodes = {"nodes": ["n0"], "world": 2, "max_restarts": 4}
    evs = [
        ev("start", 0.0, job="t-aaaa", **nodes),
        ev("launch", 0.5, attempt=0),
        ev("first_step", 1.0, attempt=0, step=1),
        ev("ckpt_complete", 21.0, attempt=0, step=20),
        ev("fault", 25.5, attempt=0, name="k", action="kill", target="all", step=25),
        ev("exit", 25.6, attempt=0, returncode=137, exit_mono=25.6),
        ev("teardown", 25.7, attempt=0, reason="exit", start_mono=25.7),
        ev("attempt_end", 25.9, attempt=0, outcome="failure", detail="exit 137",
           detected_by="exit", resume_step=0, max_step=25),
        ev("relaunch", 25.9, attempt=1, after=0, restarts=1, restarts_left=3),
        ev("launch", 26.0, attempt=1),
        ev("resumed", 27.0, attempt=1, step=20, source="memory"),
        ev("ckpt_complete", 38.0, attempt=1, step=30),
        # the SIGKILL: nothing more from supervisor 1
        ev("start", 100.0, job="t-bbbb", **nodes),
        ev("launch", 100.5, attempt=2),
        ev("resumed", 102.0, attempt=2, step=30, source="durable"),
        ev("hang", 120.0, attempt=2, ranks=[1], detected_mono=120.0),
        ev("teardown", 120.1, attempt=2, reason="hang", start_mono=120.1),
        ev("attempt_end", 120.5, attempt=2, outcome="failure", detail="hang: rank 1",
           detected_by="hang", resume_step=30, max_step=45),
        ev("relaunch", 120.5, attempt=3, after=2, restarts=1, restarts_left=3),
        ev("launch", 121.0, attempt=3),
        ev("resumed", 122.0, attempt=3, step=40, source="durable"),
        ev("attempt_end", 140.0, attempt=3, outcome="success", detected_by="exit", max_step=60),
        ev("done", 140.0, attempt=3, step=60),
        ev("supervisor_exit", 140.5, code=0, code_name="DONE", reason="the worker finished",
           restarts=1),
    ]  # fmt: skip
    metrics = {
        0: [rec(k, T0 + k, **MEM) for k in range(1, 26)],
        1: [rec(k, T0 + 7 + k, **MEM) for k in range(21, 35)],
        2: [rec(k, T0 + 72 + k, **MEM) for k in range(31, 46)],
        3: [rec(k, T0 + 82 + k, **MEM) for k in range(41, 61)],
    }
    return evs, metrics


def test_a_second_supervisor_s_summary_is_its_own(tmp_path: Path) -> None:
    """Before: "2 failures, 2 relaunches" with the killed supervisor's failure as its own, and
    "Memory tier:" for both."""
    evs, metrics = killed_then_run_again()
    a = analyze(load_run(write_run(tmp_path / "run", evs, metrics)))
    assert [(x.number, x.job, x.state, x.restarts, x.failures) for x in a.lifetimes] == [
        (1, "t-aaaa", "killed (no final event)", 1, 1),
        (2, "t-bbbb", "DONE", 1, 1),
    ]
    assert [f.lifetime for f in a.failures] == [1, 2]
    # the killed supervisor's last attempt is not the resume of its failure by the next one
    assert a.failures[0].resumed_from == 20 and a.failures[0].relaunch == "cold"
    assert a.lifetimes[0].resumed_from is None  # from scratch (attempt 1's resume is its own)
    assert a.lifetimes[1].resumed_from == 30 and a.lifetimes[1].lost == 4  # reached 34
    # each supervisor's own time (the first's up to its last step, at 41 s), not the gap
    assert a.totals.wall_s == 41.0 + 40.5
    text = summary(a, [])
    lines = text.splitlines()
    assert lines[1].startswith("== syn: DONE at step 60 in 40 s, goodput")
    assert lines[2] == ("Supervisor 2 of 2 in this run dir (started again at step 30 (durable), "
                        "4 steps lost); the lines below are its own:")  # fmt: skip
    assert lines[3].endswith("killed (no final event) at step 34, 1 failure, 1 of 4 restarts")
    assert lines[4].endswith("DONE, 1 failure, 1 of 4 restarts")
    assert "The whole run: 2 supervisors, 82 s running" in text
    assert "1 failure (0 injected), 1 relaunch, 5 steps lost" in text
    assert "2 failures, 2 relaunches, 14 steps lost." in text  # 5 + 5 + 4 to the SIGKILL
    assert "kill all" not in text  # supervisor 1's failure is not listed as this one's
    assert text.count("Memory tier:") == 1 and "Memory tier: 35 copies" in text
    md = render(a)
    assert "## Supervisor lifetimes" in md
    assert "| # | supervisor | attempt |" in md and "| 1 | 1 | 0 |" in md and "| 2 | 2 | 2 |" in md
    assert "| restarts | 2 (1 + 1: each supervisor its own budget) |" in md
    assert lifetime_marks(a) == [(pytest.approx(100 / 60), "supervisor 2 (started again)")]
    assert plot(a, tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_status_counts_the_newest_supervisor_s_budget(tmp_path: Path) -> None:
    """Before: "restarts: 2 of 4" while the second supervisor had spent 1."""
    evs, metrics = killed_then_run_again()
    run = write_run(tmp_path / "run", evs, metrics)
    out = status_lines(evs, {"restart": {"max_restarts": 4}}, run)
    assert "attempts: 2   restarts: 1 of 4 (left 3)" in out
    assert (
        out[3] == "lifetimes: 2 supervisors ran this job (attempts and restarts below: the "
        "newest's)"
    )
    assert out[4].startswith("  1: t-aaaa from ") and out[4].endswith(
        "attempts 0, 1, 1 of 4 restarts, killed (no final event)"
    )
    assert out[5].endswith("attempts 2, 3, 1 of 4 restarts, DONE")
    assert any(
        x.startswith("last failure: attempt 2: hang: rank 1 (")
        and x.endswith("attempt 3 resumed from 40 (durable); supervisor 2)")
        for x in out
    )


def test_tail_parts_the_supervisors(tmp_path: Path, capsys) -> None:
    evs, metrics = killed_then_run_again()
    run = write_run(tmp_path / "run", evs, metrics)
    assert cli.main(["tail", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = "── supervisor 2 of this run dir: job t-bbbb (started again) ──"
    assert lines.count(head) == 1
    after = lines[lines.index(head) + 1]
    assert " start " in after and after.split()[1] == "+0.000s"  # its times from its own start


def test_a_finished_job_run_again_says_its_step(tmp_path: Path) -> None:
    """Before: "DONE at step – in 195.2 min, goodput 0%"."""
    first = [
        ev("start", 0.0, job="t-aaaa", max_restarts=4),
        ev("launch", 0.5, attempt=0),
        ev("attempt_end", 30.0, attempt=0, outcome="success", max_step=30),
        ev("done", 30.0, attempt=0, step=30),
        ev("supervisor_exit", 30.5, code=0, code_name="DONE"),
    ]
    again = [
        ev("start", 11_000.0, job="t-bbbb", max_restarts=4),
        ev("launch", 11_000.5, attempt=1),
        ev("attempt_end", 11_003.0, attempt=1, outcome="success", max_step=None),
        ev("done", 11_003.0, attempt=1, step=None),
        ev("supervisor_exit", 11_003.5, code=0, code_name="DONE"),
    ]
    run = write_run(tmp_path / "run", first + again, {0: [rec(k, T0 + k) for k in range(1, 31)]})
    a = analyze(load_run(run))
    head = summary(a, []).splitlines()[1]
    assert head == "== syn: DONE at step 30 in 4 s, nothing left to train =="
    assert a.totals.final_step == 30 and round(a.totals.wall_s, 1) == 34.0


def test_status_never_names_a_standby_as_the_attempt_that_reached_a_step(tmp_path: Path) -> None:
    """Before: "step: 40 (the newest checkpoint; attempt 1 reached 0)", attempt 1 a standby that
    never trained."""
    run = tmp_path / "run"
    run.mkdir()
    evs = [
        ev("start", 0.0),
        ev("launch", 0.5, attempt=0),
        ev("progress", 20.0, attempt=0, step=44, ckpt_complete=40),
        ev("ckpt_complete", 19.0, attempt=0, step=40),
        ev("standby_launch", 10.0, attempt=1),
        ev("phase", 12.0, attempt=1, phase="standby", step=0),
        ev("prepared_launch", 13.0, attempt=2),
        ev("phase", 14.0, attempt=2, phase="standby", step=0),
    ]
    (run / "attempts" / "001").mkdir(parents=True)
    step = next(x for x in status_lines(evs, {}, run) if x.startswith("step:"))
    assert step == "step:     44 (attempt 0)"


def test_status_names_a_node_loss_and_where_the_next_attempt_resumed(tmp_path: Path) -> None:
    """Before: "last failure: attempt 0: exit 1 (…resumed from 0, reached 50)" for a node loss
    that the next attempt resumed at 40."""
    run = tmp_path / "run"
    run.mkdir()
    evs = [
        ev("start", 0.0),
        ev("launch", 0.5, attempt=0),
        ev("standby_launch", 5.0, attempt=1),
        ev("fault", 30.0, attempt=0, name="nl", action="node_loss", target="node:n1"),
        ev("attempt_end", 31.0, attempt=0, outcome="failure", detail="exit 1",
           detected_by="exit", resume_step=0, max_step=50),
        ev("relaunch", 31.0, attempt=3, after=0, mode="prepared"),
        ev("launch", 31.5, attempt=3, prepared=2),
        ev("resumed", 33.0, attempt=3, step=40, source="partner"),
    ]  # fmt: skip
    line = next(x for x in status_lines(evs, {}, run) if x.startswith("last failure:"))
    assert line == (
        "last failure: attempt 0: fault nl: node_loss node:n1 (exit 1) (detected by exit; it ran "
        "from step 0 to 50; attempt 3 resumed from 40 (partner))"
    )


def stopped_run(tmp_path: Path) -> Path:
    """Attempt 0 saved at 10 and 20 (timed by the steps after them), then was stopped by SIGINT
    at step 25 and saved there: 3 saves, the last one untimed."""
    evs = [
        ev("start", 0.0, job="t-aaaa", max_restarts=3),
        ev("launch", 0.5, attempt=0),
        ev("ckpt_complete", 11.0, attempt=0, step=10),
        ev("ckpt_complete", 21.0, attempt=0, step=20),
        ev("signal", 25.2, signal="SIGINT", count=1),
        ev("stop", 25.2, attempt=0, signal="SIGUSR1", grace_s=60),
        ev("ckpt_complete", 26.0, attempt=0, step=25),
        ev("attempt_end", 26.5, attempt=0, outcome="stopped", detected_by="stop",
           max_step=25, ckpt_complete=25),
        ev("give_up", 26.6, attempt=0, code=5, code_name="INTERRUPTED", reason="interrupted"),
        ev("supervisor_exit", 26.7, code=5, code_name="INTERRUPTED", reason="interrupted"),
    ]  # fmt: skip
    metrics = [rec(k, T0 + k) for k in range(1, 26)]
    metrics[10]["train/ckpt_save_seconds"] = 0.2
    metrics[20]["train/ckpt_save_seconds"] = 0.3
    return write_run(tmp_path / "run", evs, {0: metrics})


def test_a_graceful_stop_is_shown_as_one(tmp_path: Path) -> None:
    """Before: "last failure: none", the report "No failures." and nothing more, the gap on the
    plot unexplained; "Checkpoints: 2 saves" for 3."""
    run = stopped_run(tmp_path)
    a = analyze(load_run(run))
    stop = "attempt 0 stopped by SIGINT at step 25 (checkpoint 25)"
    text = summary(a, [])
    assert f"Stopped: {stop}." in text
    assert "Checkpoints: 3 saves (sync), training stalled 0.25 s per save (median)." in text
    assert f"No failures.\nStopped: {stop}." in render(a)
    status = status_lines(load_run(run).events, {}, run)
    assert "last failure: none" in status and f"stopped:  {stop}" in status
    assert lifetime_marks(a) == [(pytest.approx(25.2 / 60), "stopped (SIGINT)")]


def test_nodes_after_a_stop_for_want_of_nodes_are_one_set(tmp_path: Path) -> None:
    """Before: the report listed n1 as both active and excluded (the pool as `give_up` said it:
    a stopped job keeps its active list)."""
    pool = NodePool(("n0", "n1", "n2"), (), ("n1",))
    assert pool.as_dict() == {"active": ["n0", "n2"], "spares": [], "excluded": ["n1"]}
    said = {"active": ["n0", "n1", "n2"], "spares": [], "excluded": ["n1"]}  # a run from before
    evs = [
        ev("start", 0.0, nodes=["n0", "n1", "n2"], world=3),
        ev("launch", 0.5, attempt=0),
        ev("attempt_end", 10.0, attempt=0, outcome="failure", detail="exit 1",
           detected_by="exit", max_step=5, node="n1"),
        ev("node_excluded", 10.0, node="n1", reason="1 failure(s) laid on it", count=1,
           attempt=0),
        ev("give_up", 10.0, attempt=0, code=6, code_name="NODES", nodes=said,
           reason="n1 excluded and no spare node left"),
        ev("supervisor_exit", 10.1, code=6, code_name="NODES"),
    ]  # fmt: skip
    run = write_run(tmp_path / "run", evs, {0: [rec(k, T0 + k) for k in range(1, 6)]})
    a = analyze(load_run(run))
    end = "active n0, n2; spares none; excluded n1 (1 failure)"
    md = render(a)
    assert "active n0, n2, spares none, excluded n1" in md and "active n0, n1, n2," not in md
    assert f"- at the end: {end}" in md
    assert f"  at the end: {end}" in summary(a, [])
    assert f"nodes:    {end}" in status_lines(evs, {}, run)

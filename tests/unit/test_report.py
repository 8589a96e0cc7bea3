"""The report's numbers on a hand-made run whose answers are known; the CLI on bad input.

The end-to-end study (real supervisor, real worker, real faults) is in e2e/test_experiment.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from supervisor.reporting.analysis import analyze, young_daly
from supervisor.reporting.load import load_run
from supervisor.reporting.report_md import render, write_report
from tests.support import REPO, T0, ev, rec, synthetic_events, synthetic_metrics, write_run


def test_per_failure_rows_have_the_known_answers(run_dir: Path) -> None:
    a = analyze(load_run(run_dir))
    f1, f2 = a.failures
    assert (f1.attempt, f1.detected_by, f1.fault) == (0, "exit", True)
    assert f1.cause == "fault k: kill all"
    assert f1.at_s == pytest.approx(35.5)
    assert f1.detection_s == pytest.approx(0.2)  # fault 35.5 -> teardown 35.7
    assert (f1.step_at_failure, f1.resumed_from, f1.lost_steps) == (25, 20, 5)
    assert f1.restart_s == 8.0
    assert f1.downtime_s == pytest.approx(9.5)  # 35.5 -> step 21 at 45.0
    assert f1.recompute_s == pytest.approx(4.0)  # step 21 at 45 -> step 25 again at 49
    assert f1.total_s == pytest.approx(13.5)
    # No fault: a hang is placed at its last sign of life (step 40 at 64.0).
    assert (f2.attempt, f2.detected_by, f2.fault) == (1, "liveness", False)
    assert f2.cause.startswith("natural: hang")
    # 64.0 -> the finding at 70.0 (what follows it before the teardown, the stacks, is downtime)
    assert f2.at_s == pytest.approx(64.0) and f2.detection_s == pytest.approx(6.0)
    assert (f2.step_at_failure, f2.resumed_from, f2.lost_steps) == (40, 40, 0)
    assert f2.restart_s == 7.0 and f2.downtime_s == pytest.approx(16.0) and f2.recompute_s == 0


def test_totals_checkpoints_and_interval(run_dir: Path, baseline_dir: Path) -> None:
    a = analyze(load_run(run_dir), load_run(baseline_dir))
    t = a.totals
    assert t.finished and t.end == "DONE" and t.final_step == 50
    assert t.wall_s == pytest.approx(90.0)
    assert t.productive_s == pytest.approx(25.0)  # 50 new steps x 0.5 s; the 5 redone not counted
    assert t.goodput == pytest.approx(25 / 90)
    assert t.startup_s == pytest.approx(10.0)
    assert (t.restarts, t.failures, t.faults, t.lost_steps) == (2, 2, 1, 5)
    assert t.downtime_s == pytest.approx(25.5) and t.recompute_s == pytest.approx(4.0)
    assert t.baseline_wall_s == pytest.approx(60.0)
    assert t.overhead_s == pytest.approx(30.0) and t.overhead_per_failure_s == pytest.approx(15)
    assert a.skipped_lines == 2
    c = a.checkpoints
    # 40 is marked and no step after it timed it: counted all the same (issue 40 item 8)
    assert [s.step for s in c.saves] == [10, 20, 30, 40] and c.count == 4
    assert [s.timed for s in c.saves] == [True, True, True, False]
    assert c.save_median_s == pytest.approx(0.5) and c.save_max_s == pytest.approx(0.6)
    assert c.stall_total_s == pytest.approx(1.5)
    assert [round(s.marker_s, 3) for s in c.saves] == [0.3, 0.7, 0.4, 0.45]  # save -> marker
    assert a.mode == "sync"
    iv = a.interval
    assert iv is not None and iv.mtbf_s == pytest.approx(45.0)
    assert iv.young_s == pytest.approx(math.sqrt(2 * 0.5 * 45))
    assert iv.daly_s == pytest.approx(math.sqrt(45) - 0.5)
    assert iv.optimal_steps == round((math.sqrt(45) - 0.5) / 0.5)
    assert iv.run_waste > iv.optimal_waste and iv.cost_s > 0


def test_young_daly_needs_failures_and_a_save_cost() -> None:
    assert young_daly(0.5, 100.0, 0, 0.1, 10) is None
    assert young_daly(None, 100.0, 2, 0.1, 10) is None
    iv = young_daly(2.0, 1000.0, 1, 1.0, 63)  # T = 63 + 2 = 65 s is close to Daly's 61.2
    assert iv is not None and iv.optimal_steps == 61 and iv.cost_s < 1.0


def test_async_stalls_pair_stage_with_its_drain(tmp_path: Path) -> None:
    events = [ev("start", 0.0), ev("launch", 0.0, attempt=0), ev("supervisor_exit", 20.0)]
    m = [rec(k, T0 + k) for k in range(1, 16)]
    m[5].update({"train/ckpt_stage_seconds": 0.02})  # step 6: save at 5 staged
    m[7].update({"train/ckpt_drain_seconds": 0.01, "train/ckpt_marker_seconds": 1.5})
    m[10].update({"train/ckpt_stage_seconds": 0.03, "train/ckpt_wait_seconds": 0.1})
    m[12].update({"train/ckpt_drain_seconds": 0.02, "train/ckpt_marker_seconds": 1.8})
    a = analyze(load_run(write_run(tmp_path / "run", events, {0: m})))
    c = a.checkpoints
    assert a.mode == "async" and [s.step for s in c.saves] == [5, 10]
    assert [s.stall_s for s in c.saves] == pytest.approx([0.03, 0.15])
    assert [s.marker_s for s in c.saves] == [1.5, 1.8]
    assert c.stage_max_s == 0.03 and c.drain_median_s == pytest.approx(0.015)
    assert a.failures == [] and a.interval is None


def test_a_run_in_progress_reports_what_it_has(tmp_path: Path) -> None:
    events = synthetic_events()[:13]  # attempt 1 just launched
    metrics = synthetic_metrics()
    metrics.pop(2)
    metrics.pop(1)
    a = analyze(load_run(write_run(tmp_path / "run", events, metrics)))
    assert not a.totals.finished and a.totals.end == "in progress"
    (f,) = a.failures
    assert f.step_at_failure == 25 and f.resumed_from is None and f.lost_steps is None
    assert f.downtime_s is None and f.total_s is None
    assert "in progress" in render(a)


def test_empty_attempts_and_garbage_metrics_are_no_traceback(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", [ev("start", 0.0)], {0: ["not json", "[1, 2]", ""]}, "x=")
    a, text, written = write_report(run)
    assert a.skipped_lines == 2 and a.failures == [] and a.totals.final_step is None
    assert "No failures." in text and all(p.is_file() for p in written)


def test_report_md_and_png(run_dir: Path, baseline_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    a, text, written = write_report(run_dir, baseline_dir, out)
    assert written == [out / "report.md", out / "report.png"]
    md = (out / "report.md").read_text()
    assert md == text
    row = "| 1 | 0 | 0.59 | fault k: kill all | exit | 0.200 | 25 | 20 | cold | 5 | 8.00 | 9.50 |"
    assert row in md
    assert "| overhead per failure (s) | 15.00 |" in md and "| goodput" in md
    assert "Daly" in md
    assert_png(out / "report.png")


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(path))
    assert img.shape[0] > 400 and img.shape[1] > 600


def test_shipped_experiment_configs_are_valid() -> None:
    from supervisor.commands import experiment

    for name in ("restart", "agpt2b"):
        e = experiment.load(str(REPO / "configs" / "experiments" / f"{name}.toml"), [])
        assert e.phases == ["baseline", "sync", "async"]
        base, sync, asy = (experiment.phase_config(e, p) for p in e.phases)
        assert not base.faults and base.worker.flags["save_interval"] == 0
        assert sync.faults == asy.faults and sync.faults
        assert "async_ckpt" not in sync.worker.flags and asy.worker.flags["async_ckpt"] is True
        assert len({c.job.run_dir for c in (base, sync, asy)}) == 3
    agpt = experiment.load(str(REPO / "configs" / "experiments" / "agpt2b.toml"), [])
    sync = experiment.phase_config(agpt, "sync")
    assert sync.worker.flags["train_iters"] == 2000 and sync.worker.flags["save_interval"] == 100
    (fault,) = sync.faults
    assert fault.trigger.at_step == (500, 1000, 1500) and fault.trigger.after_checkpoint


def test_an_attempt_dying_before_its_first_step_is_not_the_resume(tmp_path: Path) -> None:
    events = [
        ev("start", 0.0),
        ev("launch", 0.0, attempt=0),
        ev("first_step", 1.0, attempt=0, step=1),
        ev("fault", 20.0, attempt=0, name="k", action="kill", target="all"),
        ev("teardown", 20.1, attempt=0, start_mono=20.1),
        ev("attempt_end", 20.2, attempt=0, outcome="failure", detected_by="exit", max_step=10),
        ev("launch", 21.0, attempt=1),
        ev("exit", 24.9, attempt=1, exit_mono=24.9),
        ev("teardown", 25.0, attempt=1, start_mono=25.0),
        ev("attempt_end", 25.1, attempt=1, outcome="failure", detail="exit 1",
           detected_by="exit", max_step=None),
        ev("launch", 26.0, attempt=2),
        ev("resumed", 35.0, attempt=2, step=5, restart_seconds=9.0),
        ev("first_step", 35.0, attempt=2, step=6),
        ev("supervisor_exit", 45.0, code_name="DONE"),
    ]  # fmt: skip
    metrics = {
        0: [rec(k, T0 + k) for k in range(1, 11)],
        1: [],
        2: [rec(k, T0 + 35 + (k - 6)) for k in range(6, 16)],
    }
    a = analyze(load_run(write_run(tmp_path / "run", events, metrics)))
    f1, f2 = a.failures
    assert (f1.resumed_from, f1.lost_steps, f1.restart_s) == (5, 5, 9.0)
    assert f1.downtime_s == pytest.approx(15.0) and f1.recompute_s == pytest.approx(4.0)
    assert f2.cause == "natural: exit 1" and f2.at_s == pytest.approx(24.9)
    assert f2.step_at_failure is None and f2.lost_steps is None
    assert f2.downtime_s == pytest.approx(10.1)
    assert a.totals.downtime_s == pytest.approx(15.0)  # the overlap is counted once


def test_the_end_of_run_summary_is_short(run_dir: Path, monkeypatch) -> None:
    from supervisor.reporting.summary import summary

    a, _, written = write_report(run_dir, png=False)
    monkeypatch.chdir(run_dir.parent)
    text = summary(a, written)
    lines = text.strip().splitlines()
    assert len(lines) <= 12
    assert lines[0].startswith("== ") and "goodput" in lines[0]
    assert "2 failures (1 injected), 2 relaunches, 5 steps lost, 25.5 s of downtime" in lines[1]
    row = next(line for line in lines if line.strip().startswith("1  k: kill all"))
    assert "exit" in row and "0.20 s" in row and "9.50 s" in row and "step 20" in row
    assert "Report: run/report.md" in text
    assert "python -m supervisor tail|status|report run" in text


def test_a_warm_relaunch_follows_the_relaunch_to_the_standby_s_number(tmp_path: Path) -> None:
    """Attempt 0 is killed; standby 2 (standby 1 was lost) takes over: its row says warm."""
    events = [
        ev("start", 0.0, world=2),
        ev("launch", 0.0, attempt=0),
        ev("first_step", 3.0, attempt=0, step=1),
        ev("standby_launch", 3.1, attempt=1),
        ev("standby_lost", 4.0, attempt=1, reason="hang"),
        ev("standby_launch", 5.0, attempt=2),
        ev("standby_ready", 8.0, attempt=2, seconds=3.0),
        ev("fault", 12.0, attempt=0, name="k", action="kill", target="all", step=9),
        ev("exit", 12.05, attempt=0, returncode=137, exit_mono=12.05),
        ev("teardown", 12.06, attempt=0, reason="exit", start_mono=12.06),
        ev("attempt_end", 12.1, attempt=0, outcome="failure", detected_by="exit", max_step=9),
        ev("relaunch", 12.1, attempt=2, after=0, mode="warm", delay_s=0.0),
        ev("standby_go", 12.1, attempt=2),
        ev("resumed", 12.4, attempt=2, step=5, restart_seconds=0.3),
        ev("first_step", 12.45, attempt=2, step=6),
        ev("supervisor_exit", 20.0, code=0),
    ]
    m0 = [rec(k, T0 + 3.0 + k) for k in range(1, 10)]
    m2 = [rec(k, T0 + 12.4 + (k - 6) * 0.5) for k in range(6, 12)]
    a = analyze(load_run(write_run(tmp_path / "run", events, {0: m0, 2: m2})))
    (f,) = a.failures
    assert (f.relaunch, f.resumed_from, f.lost_steps) == ("warm", 5, 4)
    assert f.downtime_s == pytest.approx(0.4)  # the kill at 12.0 -> step 6 at 12.4
    assert "| warm |" in render(a)


def test_each_resume_says_whether_it_came_from_memory_or_the_durable_tier(tmp_path: Path) -> None:
    """The synthetic run with a memory tier: attempt 1 resumed from memory (the resumed event),
    attempt 2 from the durable tier (only its attempt_end says so)."""
    events = []
    for e in synthetic_events():
        if e["event"] == "resumed" and e["attempt"] == 1:
            e = {**e, "source": "memory"}
        elif e["event"] == "resumed" and e["attempt"] == 2:
            continue
        elif e["event"] == "attempt_end" and e["attempt"] == 2:
            e = {**e, "resume_step": 40, "resume_source": "durable"}
        events.append(e)
    a = analyze(load_run(write_run(tmp_path / "run", events, synthetic_metrics())))
    f1, f2 = a.failures
    assert (f1.resumed_from, f1.resumed_source, f1.lost_steps) == (20, "memory", 5)
    assert (f2.resumed_from, f2.resumed_source, f2.lost_steps) == (40, "durable", 0)
    md = render(a)
    assert "| 25 | 20 (memory) | cold | 5 |" in md and "| 40 | 40 (durable) | cold | 0 |" in md

    from supervisor.reporting.summary import summary

    text = summary(a, [])
    assert "step 20 (memory)" in text and "step 40 (durable)" in text


def test_a_run_without_sources_renders_as_before(run_dir: Path) -> None:
    from supervisor.reporting.summary import summary

    a = analyze(load_run(run_dir))
    assert [f.resumed_source for f in a.failures] == [None, None]
    md = render(a)
    assert "| 25 | 20 | cold | 5 |" in md and "(memory)" not in md and "(durable)" not in md
    text = summary(a, [])
    assert "step 20" in text and "(memory)" not in text and "(durable)" not in text

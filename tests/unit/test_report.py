"""The report's numbers on a hand-made run whose answers are known; the CLI on bad input.

The end-to-end study (real supervisor, real worker, real faults) is in test_experiment.py.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.report import analyze, load_run, young_daly
from supervisor.report_md import render, write_report

REPO = Path(__file__).resolve().parents[1]
T0 = 1000.0  # the synthetic run's start; ts = T0 + mono


def ev(event: str, mono: float, **facts) -> dict:
    return {"event": event, "ts": T0 + mono, "mono": mono, **facts}


def rec(step: int, t: float, **extra) -> dict:
    return {"step": step, "t": t, "loss": 5.0, "train/dt": 0.5, "train/tps": 100.0, **extra}


def write_run(root: Path, events: list[dict], metrics: dict[int, list], config: str = "") -> Path:
    root.mkdir(parents=True)
    (root / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    for attempt, lines in metrics.items():
        d = root / "attempts" / f"{attempt:03d}"
        d.mkdir(parents=True)
        text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
        (d / "metrics-0.jsonl").write_text(text)
    (root / "config.toml").write_text(
        config or '[job]\nname = "syn"\n\n[worker]\nsave_interval = 10\n'
    )
    return root


def synthetic_events() -> list[dict]:
    """Attempt 0 killed by a fault at step 25 (resumes from 20); attempt 1 hangs after step 40
    (no fault: a natural failure; resumes from 40); attempt 2 finishes at step 50."""
    return [
        ev("start", 0.0, world=2),
        ev("launch", 0.0, attempt=0),
        ev("first_step", 10.0, attempt=0, step=1),
        ev("phase", 19.1, attempt=0, phase="save", step=10),
        ev("ckpt_complete", 19.4, attempt=0, step=10),
        ev("phase", 29.1, attempt=0, phase="save", step=20),
        ev("ckpt_complete", 29.8, attempt=0, step=20),
        ev("fault", 35.5, attempt=0, name="k", action="kill", target="all", step=25),
        ev("exit", 35.6, attempt=0, returncode=137, exit_mono=35.6),
        ev("teardown", 35.7, attempt=0, reason="exit", start_mono=35.7, latency_s=0.1),
        ev("attempt_end", 35.9, attempt=0, outcome="failure", detail="exit 137",
           detected_by="exit", resume_step=0, max_step=25),
        ev("relaunch", 35.9, attempt=1, after=0),
        ev("launch", 36.0, attempt=1),
        ev("resumed", 45.0, attempt=1, step=20, restart_seconds=8.0),
        ev("first_step", 45.0, attempt=1, step=21),
        ev("phase", 54.1, attempt=1, phase="save", step=30),
        ev("ckpt_complete", 54.5, attempt=1, step=30),
        ev("phase", 64.05, attempt=1, phase="save", step=40),
        ev("ckpt_complete", 64.5, attempt=1, step=40),
        ev("hang", 70.0, attempt=1, ranks=[1], detected_mono=70.0, latency_s=0.05),
        ev("teardown", 70.1, attempt=1, reason="hang", start_mono=70.1, latency_s=0.1),
        ev("attempt_end", 70.5, attempt=1, outcome="failure", detail="hang: rank 1",
           detected_by="hang", resume_step=20, max_step=40),
        ev("relaunch", 70.5, attempt=2, after=1),
        ev("launch", 71.0, attempt=2),
        ev("resumed", 80.0, attempt=2, step=40, restart_seconds=7.0),
        ev("first_step", 80.0, attempt=2, step=41),
        ev("attempt_end", 89.5, attempt=2, outcome="success", detected_by="exit", max_step=50),
        ev("done", 89.5, attempt=2, step=50),
        ev("supervisor_exit", 90.0, code=0, code_name="DONE"),
    ]  # fmt: skip


def synthetic_metrics() -> dict[int, list]:
    a0 = [rec(k, T0 + 9 + k) for k in range(1, 26)]
    a0[10]["train/ckpt_save_seconds"] = 0.4  # step 11: the save at 10
    a0[20]["train/ckpt_save_seconds"] = 0.6  # step 21: the save at 20
    a1 = [rec(k, T0 + 45 + (k - 21)) for k in range(21, 41)]
    a1[0]["train/restart_seconds"] = 8.0
    a1[10]["train/ckpt_save_seconds"] = 0.5  # step 31: the save at 30
    a1.insert(3, '{"step": 24, "t": 10')  # a torn line
    a1.insert(5, '{"step": "x", "t": 1.0}')  # a malformed one
    a2 = [rec(k, T0 + 80 + (k - 41)) for k in range(41, 51)]
    return {0: a0, 1: a1, 2: a2}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", synthetic_events(), synthetic_metrics())


@pytest.fixture
def baseline_dir(tmp_path: Path) -> Path:
    events = [
        {"event": "start", "ts": 2000.0, "mono": 500.0},
        {"event": "launch", "ts": 2000.0, "mono": 500.0, "attempt": 0},
        {"event": "first_step", "ts": 2009.0, "mono": 509.0, "attempt": 0, "step": 1},
        {"event": "done", "ts": 2059.0, "mono": 559.0, "attempt": 0, "step": 50},
        {"event": "supervisor_exit", "ts": 2060.0, "mono": 560.0, "code": 0, "code_name": "DONE"},
    ]
    metrics = {0: [{**rec(k, 2008.0 + k)} for k in range(1, 51)]}
    return write_run(tmp_path / "base", events, metrics, "[worker]\nsave_interval = 0\n")


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
    assert f2.at_s == pytest.approx(64.0) and f2.detection_s == pytest.approx(6.1)
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
    assert [s.step for s in c.saves] == [10, 20, 30] and c.count == 4  # 40 marked, not timed
    assert c.save_median_s == pytest.approx(0.5) and c.save_max_s == pytest.approx(0.6)
    assert c.stall_total_s == pytest.approx(1.5)
    assert [round(s.marker_s, 3) for s in c.saves] == [0.3, 0.7, 0.4]  # phase save -> marker
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
    assert "| 1 | 0 | 0.59 | fault k: kill all | exit | 0.200 | 25 | 20 | 5 | 8.00 | 9.50 |" in md
    assert "| overhead per failure (s) | 15.00 |" in md and "| goodput" in md
    assert "Daly" in md
    assert_png(out / "report.png")


def assert_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(path))
    assert img.shape[0] > 400 and img.shape[1] > 600


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_report(run_dir: Path, baseline_dir: Path, tmp_path: Path) -> None:
    p = cli("report", str(run_dir), "--baseline", str(baseline_dir), "--no-plot")
    assert p.returncode == 0, p.stderr
    assert "## Per failure" in p.stdout and (run_dir / "report.md").is_file()
    assert not (run_dir / "report.png").exists()
    p = cli("report", str(tmp_path / "nope"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "not a run directory" in p.stderr
    p = cli("report", str(run_dir), "--baseline", str(tmp_path / "nope"))
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_cli_experiment_bad_config_is_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "x.toml"
    bad.write_text('[experiment]\nphases = ["baseline", "chaos"]\n')
    p = cli("experiment", str(bad))
    assert p.returncode == 2 and "experiment.phases" in p.stderr and "Traceback" not in p.stderr
    bad.write_text('[experiment]\n[worker]\nmodel = "debug"\n[restart]\nmax_restarts = -1\n')
    p = cli("experiment", str(bad))
    assert p.returncode == 2 and "restart.max_restarts" in p.stderr
    p = cli("experiment", str(tmp_path / "none.toml"))
    assert p.returncode == 2 and "no such file" in p.stderr


def test_run_and_status_do_not_import_the_report() -> None:
    code = (
        "import sys, supervisor.cli as c; c.build_parser(); "
        "assert not {'matplotlib', 'supervisor.report', 'supervisor.plot'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_shipped_experiment_configs_are_valid() -> None:
    from supervisor import experiment

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
    from supervisor.summary import summary

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

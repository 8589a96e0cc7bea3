"""`status` and `tail` over a hand-made run directory (no processes but `tail -f`'s own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from supervisor import cli

REPO = Path(__file__).resolve().parents[1]


def make_run(tmp_path: Path, *, finished: bool) -> Path:
    run = tmp_path / "run"
    (run / "ckpt" / "step-20").mkdir(parents=True)
    (run / "ckpt" / "step-20" / ".complete").write_text("")
    (run / "ckpt" / "step-30").mkdir()  # not complete
    (run / "config.toml").write_text(
        f'[job]\nname = "demo"\n[restart]\nmax_restarts = 4\n[worker]\nckpt_dir = "{run}/ckpt"\n'
    )
    evs = [
        {"event": "start", "pid": 999_999_999, "ts": 1.0, "mono": 1.0},
        {"event": "launch", "attempt": 0, "ts": 2.0, "mono": 2.0},
        {"event": "progress", "attempt": 0, "step": 23, "ts": 3.0, "mono": 3.0},
        {"event": "attempt_end", "attempt": 0, "outcome": "failure", "detail": "exit 9",
         "detected_by": "exit", "resume_step": 0, "max_step": 23, "ts": 4.0, "mono": 4.0},
        {"event": "relaunch", "attempt": 1, "ts": 5.0, "mono": 5.0},
        {"event": "launch", "attempt": 1, "ts": 6.0, "mono": 6.0},
    ]  # fmt: skip
    if finished:
        evs.append({"event": "supervisor_exit", "code": 0, "code_name": "DONE",
                    "reason": "the worker finished", "ts": 9.0, "mono": 9.0})  # fmt: skip
    text = "".join(json.dumps(e) + "\n" for e in evs)
    (run / "events.jsonl").write_text(text + '{"torn li')  # a crash mid-write
    return run


def test_status_of_a_finished_run(tmp_path, capsys):
    run = make_run(tmp_path, finished=True)
    assert cli.main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "finished: DONE (exit 0)" in out
    assert "attempts: 2   restarts: 1 of 4 (left 3)" in out
    assert "step:     23 (attempt 0)" in out
    assert f"checkpoint: step 20 ({run}/ckpt/step-20)" in out
    assert "last failure: attempt 0: exit 9 (detected by exit" in out


def test_status_shows_the_newest_step_and_a_graceful_stop_is_no_failure(tmp_path, capsys):
    run = make_run(tmp_path, finished=False)
    metrics = run / "attempts" / "001" / "metrics-0.jsonl"
    metrics.parent.mkdir(parents=True)
    # Progress events come seconds apart; the newest attempt's metrics have the newest step.
    metrics.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (21, 22, 31)))
    with open(run / "events.jsonl", "a") as f:
        f.write("\n")  # end the torn line
        for e in (
            {"event": "progress", "attempt": 1, "step": 25},
            {"event": "attempt_end", "attempt": 1, "outcome": "stopped", "max_step": 31,
             "detail": "the ranks stopped gracefully", "detected_by": "exit"},
            {"event": "supervisor_exit", "code": 5, "code_name": "INTERRUPTED",
             "reason": "SIGTERM"},
        ):  # fmt: skip
            f.write(json.dumps({**e, "ts": 10.0, "mono": 10.0}) + "\n")
    assert cli.main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "step:     31 (attempt 1)" in out
    assert "last failure: attempt 0: exit 9" in out  # not the graceful stop of attempt 1


def test_status_of_a_killed_supervisor(tmp_path, capsys):
    run = make_run(tmp_path, finished=False)
    cli.main(["status", str(run)])
    assert "ended without a final event" in capsys.readouterr().out


def test_status_and_tail_of_a_non_run(tmp_path, capsys):
    assert cli.main(["status", str(tmp_path)]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_tail_renders_and_follows(tmp_path, capsys):
    run = make_run(tmp_path, finished=False)
    assert cli.main(["tail", str(run), "-n", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "relaunch" in lines[0] and "launch" in lines[1]
    assert cli.main(["tail", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["event"] == "start"
    follow = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "tail", "-f", str(run)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        for _ in range(6):
            assert follow.stdout.readline()
        with open(run / "events.jsonl", "a") as f:
            f.write('ne"}\n' + json.dumps({"event": "done", "step": 30, "ts": time.time()}) + "\n")
        line = follow.stdout.readline()  # bounded by the test timeout
        assert "done" in line and "step=30" in line
    finally:
        follow.kill()
        follow.wait(10)

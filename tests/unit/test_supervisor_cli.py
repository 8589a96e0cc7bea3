"""`status` and `tail` over a hand-made run directory; `tail -f` is in e2e."""

from __future__ import annotations

import json

from supervisor.commands import cli
from tests.support import make_run


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


def test_status_says_where_the_failed_attempt_resumed_from(tmp_path, capsys):
    run = make_run(tmp_path, finished=True)
    text = (run / "events.jsonl").read_text()
    text = text.replace('"resume_step": 0,', '"resume_step": 0, "resume_source": "durable",')
    (run / "events.jsonl").write_text(text)
    assert cli.main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "it ran from step 0 (durable) to 23; attempt 1 relaunched" in out
    cli.main(["status", str(make_run(tmp_path / "plain", finished=True))])
    assert "it ran from step 0 to 23" in capsys.readouterr().out

"""The event log outlives its file: deleted or rotated it is written anew; a full disk is said
once and never ends the job; status, tail and report work on a run dir that lost its events."""

from __future__ import annotations

import errno
import io
import json
import os

from supervisor.commands import cli
from supervisor.log import events as E


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_deleted_event_log_is_written_anew_and_says_so(tmp_path):
    path, console = tmp_path / "events.jsonl", io.StringIO()
    log = E.EventLog(path, console)
    log.emit("start", job="j")
    path.unlink()
    log.emit("launch", attempt=0)
    moved = tmp_path / "events.jsonl.1"
    path.rename(moved)  # rotated, as logrotate does
    log.emit("exit", attempt=0, returncode=0)
    log.close()
    assert [e["event"] for e in lines(moved)] == ["events_reopened", "launch"]
    assert [e["event"] for e in lines(path)] == ["events_reopened", "exit"]
    assert lines(path)[0]["count"] == 2 and lines(path)[0]["level"] == "warning"
    assert console.getvalue().count("was deleted or moved: writing a new one") == 2


def test_a_full_disk_is_said_once_and_never_raises(tmp_path, monkeypatch):
    path, console = tmp_path / "events.jsonl", io.StringIO()
    log = E.EventLog(path, console)
    log.emit("start")
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(E.os, "write", full)
    for i in range(5):
        log.emit("progress", step=i)
    assert log.failing == "No space left on device"
    assert console.getvalue().count("cannot write") == 1
    monkeypatch.setattr(E.os, "write", real_write)
    log.emit("done", step=5)
    assert log.failing is None and "works again" in console.getvalue()
    log.close()
    assert [e["event"] for e in lines(path)] == ["start", "done"]


def finished_run(tmp_path):
    run = tmp_path / "run"
    (run / "attempts" / "000").mkdir(parents=True)
    (run / "attempts" / "000" / "metrics-0.jsonl").write_text(
        "".join(
            json.dumps({"step": s, "t": 100.0 + s, "loss": 1.0, "train/dt": 0.1}) + "\n"
            for s in range(1, 6)
        )  # fmt: skip
    )
    (run / "config.toml").write_text('[job]\nname = "lost"\n[restart]\nmax_restarts = 3\n')
    return run


def test_status_tail_and_report_on_a_run_dir_without_events(tmp_path, capsys):
    run = finished_run(tmp_path)
    assert cli.main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "events.jsonl is missing (deleted?)" in out
    assert "state:    not running (the events that would say how it ended are lost)" in out
    assert "step:     5 (attempt 0)" in out
    assert cli.main(["tail", str(run)]) == 0
    assert "events.jsonl is missing" in capsys.readouterr().err
    assert cli.main(["report", str(run), "--no-plot"]) == 0
    assert "**Note:** " in (run / "report.md").read_text()
    assert cli.main(["status", str(tmp_path)]) == 2  # no run dir at all
    assert "not a run directory" in capsys.readouterr().err

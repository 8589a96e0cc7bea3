"""`status`, `tail` and `report` over hand-made run dirs (issue 24 items 8-10, issue 25 items 5
and 6): lines that are no event are skipped and counted, never a traceback; `tail` shows what a
person wants to read; `status` shows the newest step known; the memory tier's cost is reported."""

from __future__ import annotations

import json
import re

import pytest

from supervisor.commands import cli
from supervisor.commands.status import step_line
from supervisor.log import events
from supervisor.reporting.analysis import analyze
from supervisor.reporting.load import load_run
from supervisor.reporting.plot import steps_lost
from supervisor.reporting.report_md import render
from supervisor.reporting.summary import summary
from tests.support import T0, ev, make_run, rec, synthetic_events, synthetic_metrics, write_run

BINARY = b"\xff\xfe\x00garbage\x80\n"
MISTYPED = {"event": "resumed", "attempt": 1, "step": "x", "ts": 5.5, "mono": 5.5}


def spoil(run, *lines: bytes) -> None:
    """Append whole lines to the run's events.jsonl (after ending its torn last line)."""
    with open(run / "events.jsonl", "ab") as f:
        f.write(b"\n" + b"".join(lines))


def test_field_problem_names_the_event_field_and_types():
    assert events.field_problem(MISTYPED) == "resumed.step: expected an integer or null, got 'x'"
    assert events.field_problem({"event": "start", "ts": "noon"}).startswith("start.ts: expected")
    assert events.field_problem({"event": "attempt_end", "max_step": True}) is not None  # no bool
    assert events.field_problem({"event": "x", "ts": 1, "mono": 2.5, "attempt": None}) is None
    assert events.field_problem({"event": "resumed", "attempt": 1, "step": 20}) is None


@pytest.mark.parametrize(
    "line, why",
    [
        (BINARY, "not UTF-8"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"event": "x"', "not JSON"),
        (json.dumps(MISTYPED).encode(), "resumed.step: expected an integer or null, got 'x'"),
        (b"   ", None),
    ],
)
def test_parse_line_says_why_a_line_is_no_event(line, why):
    event, problem = events.parse_line(line)
    assert event is None and problem == why


def test_status_tail_and_report_skip_and_count_bad_lines(tmp_path, capsys):
    run = make_run(tmp_path, finished=True)
    spoil(run, BINARY, json.dumps(MISTYPED).encode() + b"\n")
    assert cli.main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "note: events.jsonl: 3 lines skipped (1 not JSON; 1 not UTF-8; 1 resumed.step:" in out
    assert "finished: DONE (exit 0)" in out
    assert cli.main(["tail", str(run)]) == 0
    got = capsys.readouterr()
    assert "events.jsonl: 3 lines skipped" in got.err and "supervisor_exit" in got.out
    assert cli.main(["report", str(run), "--no-plot", "--out", str(tmp_path / "r")]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert (
        "**Note:** events.jsonl: 3 lines skipped (1 not JSON; 1 not UTF-8; 1 resumed.step:" in text
    )


def test_a_mistyped_field_no_longer_breaks_the_report(tmp_path):
    evs = synthetic_events()
    for e in evs:
        if e["event"] == "resumed":
            e["step"] = "x"
        if e["event"] == "attempt_end" and e["attempt"] == 1:
            e["max_step"] = [40]
    run = write_run(tmp_path / "run", evs, synthetic_metrics())
    a = analyze(load_run(run))
    assert a.totals.final_step == 50
    assert any("3 lines skipped" in n for n in a.notes), a.notes
    render(a)  # no TypeError


# --- tail -----------------------------------------------------------------------------------------
def tail_run(tmp_path):
    evs = synthetic_events()
    evs.insert(9, ev("exit", 35.65, attempt=0, returncode=137, exit_mono=35.6, rank=None))
    return write_run(tmp_path / "run", evs, {})


def tail(capsys, *argv: str) -> tuple[list[str], str]:
    assert cli.main(["tail", *argv]) == 0
    got = capsys.readouterr()
    return got.out.splitlines(), got.err


def test_tail_hides_phase_and_ckpt_complete_unless_asked(tmp_path, capsys):
    run = tail_run(tmp_path)
    lines, err = tail(capsys, str(run))
    assert not [x for x in lines if " phase " in x or " ckpt_complete " in x]
    assert "note: 8 phase/ckpt_complete events hidden (--all shows them)" in err
    every, err = tail(capsys, str(run), "--all")
    assert len(every) == len(lines) + 8 and "hidden" not in err
    only, err = tail(capsys, str(run), "--event", "fault,attempt_end", "-n", "2")
    assert [x.split("] ")[1].split()[0] for x in only] == ["attempt_end", "attempt_end"]
    none, err = tail(capsys, str(run), "--event", "fualt")
    assert none == [] and "no fualt events in this run; its events: attempt_end," in err


def test_tail_shows_readable_times(tmp_path, capsys):
    lines, _ = tail(capsys, str(tail_run(tmp_path)), "--event", "exit,start,first_step")
    clock = r"\d\d:\d\d:\d\d\.\d{3}"
    for line in lines:
        assert re.match(rf"{clock} \+\d+\.\d{{3}}s ", line), line
        assert not re.search(r"=\d{4,}\.\d", line), line  # no raw epoch or monotonic float
    assert lines[0].split()[1] == "+0.000s"
    exit_line = next(x for x in lines if " exit " in x)
    assert exit_line.split()[1] == "+35.600s"
    assert re.search(rf"exit_mono={clock}", exit_line)
    assert events.clock(T0 + 35.6).endswith(".600")


def test_tail_refuses_a_negative_count(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["tail", str(tmp_path), "-n", "-3"])
    assert exit_.value.code == 2
    assert "expected 0 (all) or more, got -3" in capsys.readouterr().err


# --- status: the newest step ---------------------------------------------------------------------
def test_status_step_is_never_older_than_the_newest_checkpoint(tmp_path, capsys):
    """Issue 25 item 6: `step: 52` beside `checkpoint: step 80`. The newest attempt directory
    is a standby's (no metrics yet); the active attempt's metrics have the newest step."""
    run = make_run(tmp_path, finished=False)
    (run / "ckpt" / "step-80").mkdir()
    (run / "ckpt" / "step-80" / ".complete").write_text("")
    spoil(run, json.dumps({"event": "progress", "attempt": 1, "step": 52, "ts": 7.0,
                           "mono": 7.0}).encode() + b"\n")  # fmt: skip
    (run / "attempts" / "002").mkdir(parents=True)  # the standby: no metrics
    cli.main(["status", str(run)])
    out = capsys.readouterr().out
    assert "step:     80 (the newest checkpoint; attempt 1 reached 52)" in out
    metrics = run / "attempts" / "001" / "metrics-0.jsonl"
    metrics.parent.mkdir(parents=True, exist_ok=True)
    metrics.write_text("".join(json.dumps(rec(s, 8.0)) + "\n" for s in (81, 82, 83)))
    cli.main(["status", str(run)])
    out = capsys.readouterr().out
    assert "step:     83 (attempt 1)" in out and "checkpoint: step 80" in out


def test_step_line():
    assert step_line({}, None) is None
    assert step_line({}, 20) == "20 (the newest checkpoint)"
    assert step_line({0: 95, 1: 85}, 80) == "85 (attempt 1; attempt 0 had reached 95)"
    assert step_line({0: 95, 1: 85}, 90) == "90 (the newest checkpoint; attempt 1 reached 85)"
    assert step_line({0: 23}, 20) == "23 (attempt 0)"


# --- report: the memory tier and the plot's words -------------------------------------------------
def test_the_memory_tier_is_in_report_md_and_the_summary(tmp_path):
    metrics = synthetic_metrics()
    for attempt in metrics.values():
        for r in attempt:
            if isinstance(r, dict) and r["step"] > 1:
                r["train/mem_ckpt_stall_seconds"] = 0.01
                r["train/mem_ckpt_copy_seconds"] = 0.02
    a = analyze(load_run(write_run(tmp_path / "run", synthetic_events(), metrics)))
    assert a.memory is not None and a.memory.copies == 54
    text = render(a)
    assert "## Memory tier" in text and "54 copies into node-local memory" in text
    assert "| memory tier stall (s) | 0.54 |" in text
    assert "| stall per copy (s) | 0.010 | 0.010 | 0.54 |" in text
    short = summary(a, [])
    assert "Memory tier: 54 copies, training stalled 0.5 s in all (10 ms per copy, median)" in short
    plain = analyze(
        load_run(write_run(tmp_path / "plain", synthetic_events(), synthetic_metrics()))
    )
    assert plain.memory is None and "Memory tier" not in render(plain) + summary(plain, [])


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 steps lost"), (1, "1 step lost"), (12, "12 steps lost"), (None, "steps lost: ?")],
)
def test_steps_lost_wording(n, text):
    assert steps_lost(n) == text and "−" not in steps_lost(n)


def test_status_reads_another_rank_s_metrics_when_rank_0_has_none(tmp_path, capsys):
    run = make_run(tmp_path, finished=False)
    metrics = run / "attempts" / "001" / "metrics-1.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(json.dumps(rec(27, 8.0)) + "\n" + '{"step": 28, "t"')  # a torn last line
    cli.main(["status", str(run)])
    assert "step:     27 (attempt 1)" in capsys.readouterr().out

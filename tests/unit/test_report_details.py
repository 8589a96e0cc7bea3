"""The report's smaller faults of issue 40, item 9, each on a hand-made run: a `slow` fault is
no injected failure; report.png defines its boxes' words and says why a save has no bar."""

from __future__ import annotations

from pathlib import Path

from supervisor.reporting.analysis import analyze
from supervisor.reporting.load import load_run
from supervisor.reporting.report_md import render
from tests.support import T0, ev, rec, write_run


def _slow_only(tmp_path: Path) -> Path:
    """3 `slow` faults and nothing failed: 20 steps, done."""
    events = [
        ev("start", 0.0, world=2),
        ev("launch", 0.0, attempt=0),
        ev("first_step", 2.0, attempt=0, step=1),
        *[ev("fault", 4.0 + i, attempt=0, name="s", action="slow", target="rank:1", step=3 + i)
          for i in range(3)],
        ev("attempt_end", 22.0, attempt=0, outcome="success", detected_by="exit", max_step=20),
        ev("done", 22.0, attempt=0, step=20),
        ev("supervisor_exit", 22.5, code=0, code_name="DONE"),
    ]  # fmt: skip
    metrics = {0: [rec(k, T0 + 1.0 + k) for k in range(1, 21)]}
    return write_run(tmp_path / "run", events, metrics)


def test_slow_faults_are_no_injected_failures(tmp_path: Path) -> None:
    a = analyze(load_run(_slow_only(tmp_path)))
    assert a.failures == [] and (a.totals.failures, a.totals.faults) == (0, 0)
    assert a.totals.fired == {"slow": 3}
    md = render(a)
    assert "| failures (of them injected faults) | 0 (0) |" in md, md
    assert "| faults injected (by action) | 3 (slow 3) |" in md

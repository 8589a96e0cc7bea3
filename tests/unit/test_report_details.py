"""The report's smaller faults of issue 40, item 9, each on a hand-made run: a `slow` fault is
no injected failure; report.png defines its boxes' words and says why a save has no bar."""

from __future__ import annotations

from pathlib import Path

from supervisor.reporting.analysis import analyze
from supervisor.reporting.load import load_run
from supervisor.reporting.report_md import render
from tests.support import T0, ev, rec, synthetic_events, synthetic_metrics, write_run


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


def test_report_png_defines_its_boxes_words_and_says_why_a_save_has_no_bar(tmp_path: Path) -> None:
    """`restart` in a failure's box was defined nowhere, and a save no step timed (step 40 of
    the synthetic run: the hang came first) was a missing bar, unexplained."""
    from supervisor.reporting.plot import FAILURE_KEY, figure, untimed_note

    a = analyze(load_run(write_run(tmp_path / "run", synthetic_events(), synthetic_metrics())))
    fig = figure(a)
    top, stalls = fig.axes[0], fig.axes[1]
    assert "restart: the new ranks' start to their first step" in top.get_xlabel()
    assert FAILURE_KEY in top.get_xlabel() and "down: the failure to" in FAILURE_KEY
    assert untimed_note(a) in stalls.get_xlabel()
    assert "the save of step 40: no step came after" in stalls.get_xlabel()
    quiet = analyze(load_run(_slow_only(tmp_path / "quiet")))  # no failure, no save
    plain = figure(quiet)
    assert FAILURE_KEY not in plain.axes[0].get_xlabel() and untimed_note(quiet) is None
    close(fig, plain)


def test_the_node_label_sits_clear_of_the_plot_s_top_edge(tmp_path: Path) -> None:
    """The label of a node change was drawn 2% of the axes below their top, its box on the
    edge (about 4 points off, less on the shorter axes of a run with "auto" intervals)."""
    from supervisor.reporting.plot import figure
    from tests.unit.test_report_nodes import swap_events

    a = analyze(load_run(write_run(tmp_path / "run", swap_events(), synthetic_metrics())))
    fig = figure(a)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    (label,) = [t for t in ax.texts if t.get_text().startswith("excluded n1")]
    gap_pt = (ax.get_window_extent(renderer).y1
              - label.get_bbox_patch().get_window_extent(renderer).y1) * 72 / fig.dpi  # fmt: skip
    assert gap_pt >= 6, gap_pt
    steps = max(s for _, s, _ in a.curve)
    assert ax.get_ylim()[1] >= 1.15 * steps  # room above the steps for it
    close(fig)


def close(*figs) -> None:
    import matplotlib.pyplot as plt

    for fig in figs:
        plt.close(fig)


def test_report_md_names_the_saves_no_step_timed(tmp_path: Path) -> None:
    """The synthetic run's save of step 40 (the hang came before step 41): counted, and said
    to have no stall known (report.png has no bar for it)."""
    a = analyze(load_run(write_run(tmp_path / "run", synthetic_events(), synthetic_metrics())))
    md = render(a)
    assert "| saves (marked) | 4 (4) |" in md
    assert "Not timed (no bar on report.png): step 40." in md

"""Nodes shown to people: each failure's node and what followed it for the nodes (exclusion,
swap, shrink, stop) in report.md, the end-of-run summary, report.png and `status`; a job of one
node reads as before.

The hand-made run is the report tests' synthetic run on three nodes and a spare: both failures
are laid on n1, and the second takes n1 out (exclude_after = 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.commands.status import status_lines
from supervisor.log.events import level_of
from supervisor.log.events import render as render_event
from supervisor.reporting.analysis import analyze, pool_now
from supervisor.reporting.load import load_run
from supervisor.reporting.report_md import render
from supervisor.reporting.summary import summary
from tests.support import ev, synthetic_events, synthetic_metrics, write_run

WHY = "the injected fault's target"
REASON = f"2 failure(s) laid on it (exclude_after = 2): {WHY}"
STOP = "n1 excluded, no spare node left, and 2 node(s) remain, below [restart] min_nodes = 3"
SHRINK = {
    "nodes": ["n0", "n2"], "world": [3, 2], "mesh": ["dp_shard=3", "dp_shard=2"],
    "flags": {"batch_size": 3},
    "changes": ["world 3 -> 2 ranks: data parallel 3 -> 2",
                "batch_size 2 -> 3 per data-parallel rank: global batch kept at 6 sequences"],
    "batch_kept": True, "global_batch": [6, 6], "tokens_per_step": [192, 192], "problem": None,
}  # fmt: skip


def nodes_events(after: list[dict], spares: list[str] | None = None) -> list[dict]:
    """The synthetic run on n0..n2 (with `spares`), each failure laid on n1; `after` follows
    attempt 1's attempt_end."""
    out = []
    for e in synthetic_events():
        if e["event"] == "start":
            e = {
                **e,
                "nodes": ["n0", "n1", "n2"],
                "world": 3,
                **({"spares": spares} if spares else {}),
            }
        elif e["event"] == "attempt_end" and e["outcome"] == "failure":
            blame = {"node": "n1", "ranks": [1], "why": WHY}
            e = {**e, "node": "n1", "attributed": blame}
        out.append(e)
        if e["event"] == "attempt_end" and e["attempt"] == 1:
            out += after
    return out


def swap_events() -> list[dict]:
    return nodes_events(
        [ev("node_excluded", 70.5, node="n1", reason=REASON, count=2, attempt=1),
         ev("node_swapped", 70.5, out="n1", into="n3", attempt=1)],
        spares=["n3"],
    )  # fmt: skip


def shrink_events() -> list[dict]:
    return nodes_events(
        [ev("node_excluded", 70.5, node="n1", reason=REASON, count=2, attempt=1),
         ev("shrink", 70.5, attempt=1, **SHRINK)]
    )  # fmt: skip


def stop_events() -> list[dict]:
    """n1 out after attempt 1, no spare, no shrink: the job stops with exit 6."""
    evs = nodes_events([])
    cut = next(i for i, e in enumerate(evs) if e["event"] == "relaunch" and e["attempt"] == 2)
    pool = {"active": ["n0", "n2"], "spares": [], "excluded": ["n1"]}
    return evs[:cut] + [
        ev("node_excluded", 70.5, node="n1", reason=REASON, count=2, attempt=1),
        ev("give_up", 70.5, attempt=1, code=6, code_name="NODES", nodes=pool,
           reason=STOP),
        ev("supervisor_exit", 70.6, code=6, code_name="NODES"),
    ]  # fmt: skip


def analysis(tmp_path: Path, events: list[dict], name: str = "run"):
    return analyze(load_run(write_run(tmp_path / name, events, synthetic_metrics())))


# --- report.py -----------------------------------------------------------------------------------
def test_each_failure_has_its_node_and_what_followed_it(tmp_path: Path) -> None:
    a = analysis(tmp_path, swap_events())
    f1, f2 = a.failures
    assert (f1.node, f1.then) == ("n1", [])
    assert f2.node == "n1" and [n.kind for n in f2.then] == ["excluded", "swapped"]
    assert [n.short for n in f2.then] == ["excluded n1", "n1→n3"]
    start, out, swap = a.node_events
    assert (start.kind, start.nodes, start.spares, start.attempt) == (
        "start", ["n0", "n1", "n2"], ["n3"], None,
    )  # fmt: skip
    assert (out.node, out.count, out.reason, out.at_s) == ("n1", 2, REASON, pytest.approx(70.5))
    assert (swap.node, swap.into, swap.attempt) == ("n1", "n3", 1)
    assert a.shows_nodes


def test_a_node_named_only_in_attributed_counts(tmp_path: Path) -> None:
    evs = [{k: v for k, v in e.items() if k != "node"} if e["event"] == "attempt_end" else e
           for e in swap_events()]  # fmt: skip
    assert [f.node for f in analysis(tmp_path, evs).failures] == ["n1", "n1"]


def test_the_pool_after_the_node_events(tmp_path: Path) -> None:
    assert pool_now(swap_events()) == (["n0", "n3", "n2"], [], {"n1": 2})  # n3 in n1's place
    assert pool_now(shrink_events()) == (["n0", "n2"], [], {"n1": 2})
    assert pool_now(stop_events()) == (["n0", "n2"], [], {"n1": 2})
    assert pool_now(synthetic_events()) is None  # a run from before nodes were recorded
    # A supervisor started again in the run dir begins with the config's nodes again.
    again = [*swap_events(), ev("start", 200.0, nodes=["n0", "n1", "n2"], spares=["n3"])]
    assert pool_now(again) == (["n0", "n1", "n2"], ["n3"], {})


# --- report.md -----------------------------------------------------------------------------------
def test_report_md_has_a_node_column_a_then_note_and_a_nodes_section(tmp_path: Path) -> None:
    md = render(analysis(tmp_path, swap_events()))
    assert "| # | attempt | at (min) | cause | node | detected by |" in md
    assert md.splitlines()[md.splitlines().index("## Per failure") + 2].endswith(
        "| total (s) | then |"
    )
    assert "| 1 | 0 | 0.59 | fault k: kill all | n1 | exit |" in md
    row1 = next(line for line in md.splitlines() if line.startswith("| 1 |"))
    row2 = next(line for line in md.splitlines() if line.startswith("| 2 |"))
    assert row1.endswith("| – |") and row2.endswith("| excluded n1; n1→n3 |")
    section = md.split("## Nodes\n\n")[1].split("\n\n")[0].splitlines()
    assert section == [
        "- start: 3 active (n0, n1, n2); spare n3",
        f"- 1.18 min, after attempt 1: excluded **n1**: {REASON}",
        "- 1.18 min, after attempt 1: spare **n3** took n1's place",
        "- at the end: active n0, n3, n2; spares none; excluded n1 (2 failures)",
    ]


def test_report_md_says_what_a_shrink_changed(tmp_path: Path) -> None:
    md = render(analysis(tmp_path, shrink_events()))
    assert "| excluded n1; shrink to 2 nodes |" in md
    section = md.split("## Nodes\n\n")[1].split("\n\n")[0].splitlines()
    assert section[0] == "- start: 3 active (n0, n1, n2); no spares"
    assert section[2] == (
        "- 1.18 min, after attempt 1: **shrink** to 2 node(s) (n0, n2); world 3 → 2 ranks; "
        "mesh dp_shard=3 → dp_shard=2; flags batch_size = 3; global batch kept"
    )
    assert section[3:-1] == [f"  - {c}" for c in SHRINK["changes"]]
    assert section[-1] == "- at the end: active n0, n2; spares none; excluded n1 (2 failures)"


def test_a_custom_worker_s_shrink_names_only_the_world(tmp_path: Path) -> None:
    evs = nodes_events(
        [ev("node_excluded", 70.5, node="n1", reason="", count=2, attempt=1),
         ev("shrink", 70.5, attempt=1, nodes=["n0", "n2"], world=[3, 2])]
    )  # fmt: skip
    md = render(analysis(tmp_path, evs))
    assert "excluded **n1** (2 failures)" in md
    assert "**shrink** to 2 node(s) (n0, n2); world 3 → 2 ranks; no worker flags changed" in md
    assert "global batch" not in md


def test_report_md_says_the_job_stopped_for_want_of_nodes(tmp_path: Path) -> None:
    a = analysis(tmp_path, stop_events())
    assert a.failures[-1].then[-1].kind == "stop"
    md = render(a)
    assert "| excluded n1; stopped: too few nodes |" in md
    assert (
        f"- 1.18 min, after attempt 1: **stopped** (exit 6, NODES): {STOP}; active n0, n2, "
        "spares none, excluded n1"
    ) in md


def test_several_nodes_and_no_node_event_still_show_the_column(tmp_path: Path) -> None:
    a = analysis(tmp_path, nodes_events([]))
    assert a.shows_nodes and [f.then for f in a.failures] == [[], []]
    md = render(a)
    assert "| cause | node |" in md and "## Nodes" in md


# --- a single node reads as before ---------------------------------------------------------------
def single_node_events() -> list[dict]:
    return [
        {**e, "nodes": ["localhost"], "world": 2} if e["event"] == "start" else e
        for e in synthetic_events()
    ]


def test_a_single_node_job_reads_as_before(tmp_path: Path) -> None:
    old = analysis(tmp_path, synthetic_events(), "old")
    one = analysis(tmp_path, single_node_events(), "one")
    assert not old.shows_nodes and not one.shows_nodes
    assert [f.node for f in one.failures] == [None, None]
    assert render(one).replace("/one", "/old") == render(old)
    assert "| node |" not in render(one) and "## Nodes" not in render(one)
    assert summary(one, []) == summary(old, []).replace("/old", "/one")
    assert "Nodes" not in summary(one, [])
    run = tmp_path / "one"
    assert not [line for line in status_lines(single_node_events(), {}, run)
                if line.startswith("nodes:")]  # fmt: skip


# --- the end-of-run summary ----------------------------------------------------------------------
def test_the_summary_has_a_node_column_and_a_line_per_node_event(tmp_path: Path) -> None:
    lines = summary(analysis(tmp_path, swap_events()), []).splitlines()
    header = next(line for line in lines if line.strip().startswith("#  failure"))
    assert header.split()[:4] == ["#", "failure", "node", "detected"]
    row = next(line for line in lines if line.strip().startswith("1  k: kill all"))
    assert row.split()[4] == "n1"
    at = lines.index("Nodes: n0, n1, n2 (spare n3)")
    assert lines[at + 1 : at + 3] == [
        "  after attempt 1: excluded n1 (2 failures laid on it)",
        "  after attempt 1: spare n3 in for n1",
    ]
    text = summary(analysis(tmp_path, shrink_events(), "shrink"), [])
    assert (
        "  after attempt 1: shrink to 2 nodes (n0, n2), world 3 → 2, batch_size = 3, "
        "global batch kept"
    ) in text
    text = summary(analysis(tmp_path, stop_events(), "stop"), [])
    assert f"  after attempt 1: stopped: too few nodes: {STOP}" in text


# --- report.png ----------------------------------------------------------------------------------
def test_the_timeline_marks_each_failure_s_node_changes_together(tmp_path: Path) -> None:
    from supervisor.reporting.plot import node_marks, plot

    a = analysis(tmp_path, swap_events())
    assert node_marks(a) == [(pytest.approx(70.5 / 60), "excluded n1\nn1→n3")]
    assert node_marks(analysis(tmp_path, single_node_events(), "one")) == []
    out = plot(a, tmp_path / "report.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- status and tail -----------------------------------------------------------------------------
def nodes_line(events: list[dict], run: Path) -> list[str]:
    return [line for line in status_lines(events, {}, run) if line.startswith("nodes:")]


def test_status_lists_active_spare_and_excluded_nodes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    evs = swap_events()
    assert nodes_line(evs, run) == [
        "nodes:    active n0, n3, n2; spares none; excluded n1 (2 failures)"
    ]
    before = evs[: next(i for i, e in enumerate(evs) if e["event"] == "node_excluded")]
    assert nodes_line(before, run) == ["nodes:    active n0, n1, n2; spares n3; excluded none"]
    assert nodes_line(shrink_events(), run) == [
        "nodes:    active n0, n2; spares none; excluded n1 (2 failures)"
    ]
    assert nodes_line(stop_events(), run) == [
        "nodes:    active n0, n2; spares none; excluded n1 (2 failures)"
    ]
    one = [ev("start", 0.0, nodes=["n0"], spares=["n1"])]  # one node and a spare
    assert nodes_line(one, run) == ["nodes:    active n0; spares n1; excluded none"]
    out = status_lines(evs, {}, run)
    assert out.index(nodes_line(evs, run)[0]) == 4  # after the attempts line


def test_node_events_are_warnings_in_tail() -> None:
    for name in ("node_excluded", "node_swapped", "shrink"):
        assert level_of({"event": name}) == "warning"
    line = render_event(ev("node_swapped", 1.0, out="n1", into="n3", attempt=1))
    assert "warning" in line and "out=n1" in line and "into=n3" in line

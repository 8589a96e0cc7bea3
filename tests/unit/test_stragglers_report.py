"""Stragglers as `status` and the report show them: each `straggler` event with what followed
it (a spare in its node's place, the node left out, or only the event)."""

from __future__ import annotations

from supervisor.reporting.stragglers_md import straggler_rows, stragglers_lines, stragglers_md


def straggler(node: str, action: str, done: str, **extra) -> dict:
    return {"event": "straggler", "attempt": 0, "step": 11, "ranks": [2], "node": node,
            "score": 2.254, "window": 10, "action": action, "done": done, **extra}  # fmt: skip


def test_a_replaced_straggler_says_its_spare():
    events = [
        straggler("n2", "replace", "a spare takes its node's place"),
        {"event": "node_excluded", "node": "n2"},
        {"event": "node_swapped", "out": "n2", "into": "n4"},
    ]
    (row,) = straggler_rows(events)
    assert (row.ranks, row.node, row.score, row.done) == (
        "2",
        "n2",
        2.254,
        "replaced by the spare n4",
    )
    assert stragglers_lines([row]) == [
        "straggler: step 11: rank(s) 2 on n2, score 2.25 over 10: replaced by the spare n4"
    ]
    table = stragglers_md([row])
    assert table[0].startswith("| attempt | step | ranks | node | score | window | done |")
    assert table[2] == "| 0 | 11 | 2 | n2 | 2.25 | 10 | replaced by the spare n4 |"


def test_a_shrink_a_report_and_a_replacement_that_never_came():
    events = [
        straggler("n1", "replace", "its node is excluded (shrink)"),
        {"event": "shrink", "nodes": ["n0", "n2"]},
        straggler("n2", "report", "reported"),
        straggler("n0", "replace", "a spare takes its node's place"),
    ]
    rows = straggler_rows(events)
    assert [r.done for r in rows] == [
        "excluded; the job shrank",
        "reported",
        "a spare takes its node's place (not done)",
    ]
    assert stragglers_md([]) == [] and straggler_rows([{"event": "launch"}]) == []

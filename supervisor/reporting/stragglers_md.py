"""Stragglers as `status` and the report show them: every `straggler` event of a run, with what
was done about it (reported, or its node replaced by a spare or left out), as table rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StragglerRow:
    """One `straggler` event, and what followed it."""

    attempt: int | None
    step: int | None
    ranks: str
    node: str
    score: float | None
    window: int | None
    done: str  # what was done, in words
    since: int | None = None  # the step of the window's first observation

    def judged(self) -> str:
        """The window in words: its observations, and the steps they span when known."""
        n = "–" if self.window is None else str(self.window)
        if self.since is None or self.step is None:
            return n
        return f"{n} (steps {self.since}-{self.step})"


def straggler_rows(events: list[dict[str, Any]]) -> list[StragglerRow]:
    """The run's stragglers (pure: `events` as read from events.jsonl). A replacement that
    happened is said as such: the spare that took the node's place, or the node left out."""
    rows = []
    for i, e in enumerate(events):
        if e.get("event") != "straggler":
            continue
        node = str(e.get("node", "?"))
        done = str(e.get("done", e.get("action", "reported")))
        if e.get("action") == "replace":
            later = events[i + 1 :]
            done = _replaced(later, node) or f"{done} (not done{_why_not(later, e)})"
        score = e.get("score")
        rows.append(
            StragglerRow(
                e.get("attempt"),
                e.get("step"),
                ",".join(str(r) for r in e.get("ranks") or []) or "–",
                node,
                score if isinstance(score, (int, float)) else None,
                e.get("window"),
                done,
                e.get("since_step") if isinstance(e.get("since_step"), int) else None,
            )
        )
    return rows


def _replaced(later: list[dict[str, Any]], node: str) -> str | None:
    """How `node` left the job after its straggler event, if it did."""
    for e in later:
        name = e.get("event")
        if name == "node_swapped" and e.get("out") == node:
            return f"replaced by the spare {e.get('into')}"
        if name == "shrink" and node not in (e.get("nodes") or [node]):
            return "excluded; the job shrank"
        if name == "straggler" and e.get("node") == node:
            return None
    return None


def _why_not(later: list[dict[str, Any]], found: dict[str, Any]) -> str:
    """Why a replacement never came: its attempt ended first (a failure, the job's end)."""
    for e in later:
        if e.get("event") == "attempt_end" and e.get("attempt") == found.get("attempt"):
            if e.get("outcome") == "stopped":
                return ""
            return f": attempt {e.get('attempt')} ended first, {e.get('outcome', '?')}"
    return ""


def stragglers_md(rows: list[StragglerRow]) -> list[str]:
    """The report's table (none: no lines)."""
    if not rows:
        return []
    out = ["| attempt | step | ranks | node | score | window | done |", "| --- " * 7 + "|"]
    for r in rows:
        score = "–" if r.score is None else f"{r.score:.2f}"
        cells = [r.attempt, r.step, r.ranks, r.node, score, r.judged(), r.done]
        out.append("| " + " | ".join("–" if c is None else str(c) for c in cells) + " |")
    return out


def stragglers_lines(rows: list[StragglerRow]) -> list[str]:
    """`status`'s lines: one per straggler."""
    return [
        f"straggler: step {r.step}: rank(s) {r.ranks} on {r.node}, score "
        f"{'?' if r.score is None else f'{r.score:.2f}'} over {r.judged()}: {r.done}"
        for r in rows
    ]

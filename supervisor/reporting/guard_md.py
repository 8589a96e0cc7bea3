"""The report's numerical-guard section: every `numeric_fault` and `rollback` event of a run,
in order, as one table (what the ranks' guard caught and what it did about it)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

GUARD_EVENTS = ("numeric_fault", "rollback")


@dataclass(frozen=True)
class GuardRow:
    """One guard event as the report shows it."""

    t_s: float | None  # seconds since the job started
    attempt: int | None
    event: str
    step: int | None  # the bad step (a rollback: the step it rolled back from)
    kind: str  # nan | inf | spike; a rollback: "rollback"
    value: str  # the value judged bad; a rollback: "–"
    ranks: str
    then: str  # what the guard did: "skip", "rollback", "to step N, skip A-B"


def guard_rows(events: list[dict[str, Any]], t0: float | None) -> list[GuardRow]:
    """The run's guard events (pure: `events` as read from events.jsonl)."""
    rows = []
    for e in events:
        name = e.get("event")
        if name not in GUARD_EVENTS:
            continue
        ts = e.get("ts")
        t = ts - t0 if isinstance(ts, (int, float)) and t0 is not None else None
        if name == "numeric_fault":
            ranks = e.get("ranks") or []
            rows.append(GuardRow(t, e.get("attempt"), name, e.get("step"), str(e.get("kind")),
                                 _value(e.get("value")), ",".join(map(str, ranks)) or "–",
                                 str(e.get("action", "–"))))  # fmt: skip
        else:
            then = f"to step {e.get('to_step')}, skip {e.get('skip')}"
            rows.append(GuardRow(t, e.get("attempt"), name, e.get("from_step"), "rollback", "–",
                                 "–", then))  # fmt: skip
    return rows


def _value(v: Any) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return f"{v:.6g}"
    return str(v)


def guard_md(rows: list[GuardRow]) -> list[str]:
    """The section's lines; none when the guard said nothing (a healthy run)."""
    if not rows:
        return []
    header = ["at (min)", "attempt", "event", "step", "kind", "value", "ranks", "then"]
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for r in rows:
        at = "–" if r.t_s is None else f"{r.t_s / 60:.2f}"
        attempt = "–" if r.attempt is None else str(r.attempt)
        step = "–" if r.step is None else str(r.step)
        cells = [at, attempt, r.event, step, r.kind, r.value, r.ranks, r.then]
        out.append("| " + " | ".join(cells) + " |")
    faults = sum(r.event == "numeric_fault" for r in rows)
    rollbacks = len(rows) - faults
    out += ["", f"{faults} bad step(s) caught and not applied; {rollbacks} rollback(s)."]
    return out


def guard_line(rows: list[GuardRow]) -> str | None:
    """`run`'s summary line: what the guard caught (None when nothing)."""
    faults = [r for r in rows if r.event == "numeric_fault"]
    if not faults:
        return None
    kinds = ", ".join(f"step {r.step} {r.kind}" for r in faults[:5])
    more = f" and {len(faults) - 5} more" if len(faults) > 5 else ""
    rollbacks = len(rows) - len(faults)
    return (
        f"Numerical guard: {len(faults)} bad step(s) not applied ({kinds}{more}), "
        f"{rollbacks} rollback(s)."
    )

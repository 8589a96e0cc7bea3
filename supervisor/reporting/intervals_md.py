"""The report's section on "auto" checkpoint intervals: every `interval_changed` event of a run,
in order (the interval over time, and what each decision went by); report.png plots the same."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class IntervalRow:
    """One decision as the report shows it."""

    t_s: float | None  # seconds since the job started
    tier: str  # memory | durable
    old: int | None  # None: the first decision (the ranks had tuned it themselves)
    new: int
    why: str  # cost | failure
    cost_s: float | None
    step_s: float | None
    mtbf_s: float | None
    failures: int | None


def interval_rows(events: list[dict[str, Any]], t0: float | None) -> list[IntervalRow]:
    """The run's interval decisions (pure: `events` as read from events.jsonl)."""
    rows = []
    for e in events:
        if e.get("event") != "interval_changed" or not isinstance(e.get("new"), int):
            continue
        ts = e.get("ts")
        t = ts - t0 if isinstance(ts, (int, float)) and t0 is not None else None
        rows.append(
            IntervalRow(
                t, str(e.get("tier")), _int(e.get("old")), e["new"], str(e.get("why", "?")),
                _num(e.get("cost_s")), _num(e.get("step_s")), _num(e.get("mtbf_s")),
                _int(e.get("failures")),
            )
        )  # fmt: skip
    return rows


def intervals_md(rows: list[IntervalRow]) -> list[str]:
    """A line of what changed per tier, then one row per decision."""
    if not rows:
        return []
    lines = []
    for tier in dict.fromkeys(r.tier for r in rows):
        mine = [r for r in rows if r.tier == tier]
        path = " → ".join(str(r.new) for r in mine)
        lines.append(f"- {tier}: {len(mine)} decisions, in steps: {path}")
    lines += [
        "",
        "| min | tier | interval | why | cost per copy/save (s) | step (s) | MTBF estimate (s) "
        "| failures |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        t = f"{r.t_s / 60:.2f}" if r.t_s is not None else "?"
        old = "own" if r.old is None else str(r.old)
        seen = "?" if r.failures is None else str(r.failures)
        lines.append(
            f"| {t} | {r.tier} | {old} → {r.new} | {r.why} | {_f(r.cost_s, 4)} | "
            f"{_f(r.step_s, 3)} | {_f(r.mtbf_s, 1)} | {seen} |"
        )
    lines += [
        "",
        "own: the ranks' own interval, from the prior MTBF, before the first decision. Each "
        "decision is Young/Daly for the cost, the step and the MTBF estimated from this job's "
        "failures (docs/checkpoints.md, intervals that tune themselves).",
    ]
    return lines


def _f(v: float | None, digits: int) -> str:
    return "?" if v is None else f"{v:.{digits}f}"


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None

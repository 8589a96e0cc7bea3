"""The supervisor lifetimes of a run dir for people: report.md's section, the summary's lines
and `status`'s. Shown only when more than one supervisor ran the job; a run dir of one reads as
before."""

from __future__ import annotations

from supervisor.log.events import clock
from supervisor.reporting.lifetimes import Lifetime, Stop


def lifetimes_md(lives: list[Lifetime]) -> list[str]:
    """A row per lifetime, then the settings each continuation changed."""
    if len(lives) <= 1:
        return []
    header = ["supervisor", "job", "started", "ran (min)", "resumed from", "reached", "attempts",
              "failures", "restarts (its own budget)", "goodput", "ended"]  # fmt: skip
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for life in lives:
        row = [
            str(life.number), life.job or "–", _clock(life.started_ts), f"{life.wall_s / 60:.2f}",
            resumed(life), _n(life.final_step), _attempts(life.attempts), str(life.failures),
            life.budget, f"{life.goodput:.0%}", ended(life),
        ]  # fmt: skip
        out.append("| " + " | ".join(row) + " |")
    for life in lives:
        if life.changes:
            out += ["", f"Lifetime {life.number} continued the job with changed settings:"]
            out += [f"- {c}" for c in life.changes]
    return out


def summary_lines(lives: list[Lifetime]) -> list[str]:
    """Which lifetime the summary's lines are, and one line for each of them."""
    if len(lives) <= 1:
        return []
    newest = lives[-1]
    how = "continued" if newest.continued else "started again"
    where = f" at step {resumed(newest)}" if newest.resumed_from is not None else ""
    out = [f"Supervisor {newest.number} of {len(lives)} in this run dir ({how}{where}); "
           "the lines below are its own:"]  # fmt: skip
    for life in lives:
        out.append(
            f"  {life.number}: {_clock(life.started_ts)}, {_duration(life.wall_s)}, "
            f"{ended(life)}, {_count(life.failures, 'failure')}, {life.budget}"
        )
    return out


def status_lines(lives: list[Lifetime]) -> list[str]:
    """`lifetimes: 2 supervisors ran this job` and a line each (status reads the newest's
    attempts and restarts; this says the others')."""
    if len(lives) <= 1:
        return []
    out = [f"lifetimes: {len(lives)} supervisors ran this job (attempts and restarts below: "
           f"the newest's)"]  # fmt: skip
    for life in lives:
        out.append(
            f"  {life.number}: {life.job or '?'} from {_clock(life.started_ts)}, "
            f"attempts {_attempts(life.attempts)}, {life.budget}, {ended(life)}"
            + (f"; continued at step {resumed(life)}" if life.continued else "")
        )
    return out


def stop_line(stop: Stop, lifetime: bool) -> str:
    """`attempt 3 stopped by SIGINT at step 150 (checkpoint 150)`, and its lifetime."""
    who = f"attempt {stop.attempt} " if stop.attempt is not None else ""
    where = f" (supervisor {stop.lifetime})" if lifetime else ""
    return f"{who}{stop.line}{where}"


def ended(life: Lifetime) -> str:
    """How a lifetime ended: `DONE`, `INTERRUPTED: stopped by SIGINT at step 150 (checkpoint
    150)`, `killed (no final event) at step 24`, `in progress`."""
    if life.stop is not None:
        return f"{life.state}: {life.stop.line}"
    if life.end is None:
        return life.state + (f" at step {life.final_step}" if life.final_step is not None else "")
    return f"{life.state}: {life.reason}" if life.reason and life.end != "DONE" else life.state


def resumed(life: Lifetime) -> str:
    if life.resumed_from is None:
        return "–"
    source = f" ({life.resumed_source})" if life.resumed_source else ""
    lost = f", {_count(life.lost, 'step')} lost" if life.lost else ""
    return f"{life.resumed_from}{source}{lost}"


def _attempts(attempts: list[int]) -> str:
    if not attempts:
        return "none"
    if attempts == list(range(attempts[0], attempts[-1] + 1)) and len(attempts) > 2:
        return f"{attempts[0]}-{attempts[-1]}"
    return ", ".join(map(str, attempts))


def _clock(ts: float | None) -> str:
    return "?" if ts is None else clock(ts)[:8]


def _n(v: int | None) -> str:
    return "–" if v is None else str(v)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"

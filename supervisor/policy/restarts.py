"""Across attempts: after one ended, finish, relaunch (after how long) or stop, and why.

The facts are the attempts so far (`AttemptRecord`: where each resumed, how far it got, what it
saved, its error) and the restart config; the answer is a `Decision` with the job's exit code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from contracts.exit_codes import ExitCode
from supervisor.policy.error_lines import allocation_gone, unfixable
from supervisor.policy.exits import Outcome
from supervisor.settings.config import RestartConfig


@dataclass(frozen=True)
class AttemptRecord:
    """One finished attempt: where it resumed and how far it got (None: never got there)."""

    attempt: int
    resume_step: int | None
    max_step: int | None
    outcome: str = "failure"
    error: str | None = None  # what the ranks or the launcher said last (`error_of`)
    # The newest checkpoint it completed: durable, or a memory-tier copy every rank holds.
    saved_step: int | None = None


def made_progress(rec: AttemptRecord, min_steps: int) -> bool:
    if rec.max_step is None:
        return False
    return rec.max_step - (rec.resume_step or 0) >= min_steps


def consecutive_unproductive(history: Sequence[AttemptRecord], min_steps: int) -> int:
    """Failed attempts in a row, counted back from the last, that made no progress."""
    n = 0
    for rec in reversed(history):
        if made_progress(rec, min_steps):
            break
        n += 1
    return n


def backoff_delay(unproductive: int, schedule: Sequence[float]) -> float:
    """The schedule's entry for this many unproductive attempts in a row; the last repeats."""
    return float(schedule[min(max(unproductive, 0), len(schedule) - 1)])


def saved_progress(rec: AttemptRecord) -> bool:
    """The attempt completed a checkpoint (durable, or a memory copy every rank holds) newer
    than the one it resumed from: the next attempt resumes further on."""
    return rec.saved_step is not None and rec.saved_step > (rec.resume_step or 0)


def stuck_resume(history: Sequence[AttemptRecord], times: int) -> list[int] | None:
    """The resume steps of the last `times` attempts when each of them resumed (stepped) and
    none completed a checkpoint newer than its resume step (`saved_progress`); else None.
    Steps made and lost again are no progress: a relaunch would resume where they did."""
    last = history[-times:]
    if len(last) < times or any(r.resume_step is None or saved_progress(r) for r in last):
        return None
    return [r.resume_step for r in last if r.resume_step is not None]


def early_repeat(history: Sequence[AttemptRecord], times: int = 2) -> str | None:
    """The error of the last `times` attempts if each failed before its first step with that
    same error: relaunching again would only fail the same way."""
    last = history[-times:]
    if len(last) < times or any(r.max_step is not None or r.outcome != "failure" for r in last):
        return None
    errors = {r.error for r in last}
    return last[0].error if len(errors) == 1 and last[0].error else None


def restarts_left(max_restarts: int, restarts_done: int) -> int:
    return max(0, max_restarts - restarts_done)


@dataclass(frozen=True)
class Decision:
    action: Literal["done", "relaunch", "stop"]
    exit_code: ExitCode
    reason: str
    delay_s: float = 0.0
    facts: dict = field(default_factory=dict)


def decide(
    outcome: Outcome,
    history: Sequence[AttemptRecord],
    restarts_done: int,
    cfg: RestartConfig,
    interrupted: bool = False,
) -> Decision:
    """After an attempt ended (`history` includes it): finish, relaunch, or stop, and why."""
    if outcome.kind == "success":
        return Decision("done", ExitCode.DONE, outcome.detail)
    if outcome.kind == "diverged":  # the same settings diverge again: a person must change them
        return Decision("stop", ExitCode.DIVERGED, outcome.detail)
    if interrupted or outcome.kind == "stopped":
        return Decision("stop", ExitCode.INTERRUPTED, "interrupted: " + outcome.detail)
    if outcome.kind == "bad_input":
        return Decision("stop", ExitCode.USAGE, outcome.detail)
    last_error = history[-1].error if history else None
    cannot = unfixable(last_error)
    if cannot is not None:
        return Decision("stop", ExitCode.USAGE, cannot)
    gone = allocation_gone(last_error)
    if gone is not None:  # its nodes are gone with it
        return Decision("stop", ExitCode.NODES, gone)
    repeated = early_repeat(history)
    if repeated is not None:
        return Decision(
            "stop",
            ExitCode.NO_PROGRESS,
            f"2 attempts in a row failed before their first step with: {repeated}",
            facts={"error": repeated},
        )
    steps = stuck_resume(history, cfg.max_same_resume)
    if steps is not None:
        n = cfg.max_same_resume
        if len(set(steps)) == 1:
            said = f"resumed from step {steps[0]} and completed no newer checkpoint"
        else:
            said = (
                "completed no checkpoint newer than the one each resumed from (steps "
                f"{', '.join(map(str, steps))})"
            )
        return Decision(
            "stop",
            ExitCode.NO_PROGRESS,
            f"no progress: {n} attempts in a row {said}",
            facts={"resume_step": steps[-1]},
        )
    if restarts_done >= cfg.max_restarts:
        return Decision(
            "stop",
            ExitCode.BUDGET,
            f"restart budget exhausted ({cfg.max_restarts} restarts)",
        )
    delay = backoff_delay(consecutive_unproductive(history, cfg.min_progress_steps), cfg.backoff_s)
    return Decision("relaunch", ExitCode.DONE, outcome.detail, delay_s=delay)

"""What an attempt's end means: the launcher's exit status and the ranks' findings turned into
an outcome (success, a graceful stop, bad input, a run that diverged, or a failure worth
another attempt).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Literal

from contracts.exit_codes import WORKER_DIVERGED, WORKER_USAGE
from supervisor.policy.error_lines import MAX_ERROR_CHARS
from supervisor.policy.liveness import Finding

FAILED = ("failure", "bad_input", "diverged")  # the outcomes that are failures
DIVERGED_EXIT = "the numerical guard gave up (exit 3)"
NO_HELLO_EXIT = (
    "exit 0 and no rank said hello: the worker never spoke to the supervisor (its first message, "
    "docs/worker-protocol.md)"
)


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended. Only `failure` is worth another attempt."""

    kind: Literal["success", "stopped", "bad_input", "diverged", "failure"]
    detail: str


def describe_returncode(rc: int) -> str:
    """`exit 1`, `killed by SIGKILL`, `exit 137 (SIGKILL)`: launchers report signals as 128+N."""
    if rc < 0:
        return f"killed by {_signame(-rc)}"
    if rc > 128 and _signame(rc - 128, None):
        return f"exit {rc} ({_signame(rc - 128)})"
    return f"exit {rc}"


def _signame(n: int, default: str | None = "signal") -> str | None:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"{default} {n}" if default else None


def classify_exit(
    returncode: int, *, done: bool, stopping: bool, stepped: bool, said_hello: bool = True
) -> Outcome:
    """The attempt's outcome from the launcher's exit status and what the ranks said.

    - 0 and a rank said `done`: success.
    - 0 after the supervisor asked the ranks to stop: a graceful stop.
    - 2 before any step: the worker rejected its flags or inputs; relaunching cannot help.
    - 3: the numerical guard gave up (the run diverged); relaunching would diverge again.
    - anything else (a signal, a code, or 0 without `done`): a failure, whose line names the
      part of the worker protocol broken where it is one (no rank `said_hello`).
    """
    what = describe_returncode(returncode)
    if returncode == 0 and done:
        return Outcome("success", "the worker finished")
    if returncode == 0 and stopping:
        return Outcome("stopped", "the ranks stopped gracefully")
    if returncode == WORKER_USAGE and not stepped and not stopping:
        return Outcome("bad_input", "the worker rejected its input (exit 2)")
    if returncode == WORKER_DIVERGED:
        return Outcome("diverged", DIVERGED_EXIT)
    if returncode == 0 and not said_hello:
        return Outcome("failure", NO_HELLO_EXIT)
    if returncode == 0:
        return Outcome("failure", "exit 0 before the worker said done")
    return Outcome("failure", what)


def attempt_outcome(
    finding: Finding | None,
    returncode: int | None,
    *,
    done: bool,
    stopping: bool,
    stepped: bool,
    diverged: str | None = None,
    said_hello: bool = True,
    refused: str | None = None,
) -> Outcome:
    """The ranks' word decides first: that their guard gave up (`diverged`: its line), or, before
    any step, that one refused its input (`refused`: its line). The rank ends right after, and
    whichever of its exit or the finding it leads to is seen first (a rank gone, the launcher's
    status) says less: a peer still in its grace keeps the launcher from ending. Else a finding
    (a rank gone, a hang, no progress) makes the attempt a failure, and else its exit status
    decides (None: no status was collected, as for a process killed in teardown).
    `said_hello`: some rank did."""
    if diverged is not None and not done:
        return Outcome("diverged", diverged)
    if refused is not None and not done and not stopping and not stepped:
        line = (refused.strip().splitlines() or [""])[-1][:MAX_ERROR_CHARS]
        return Outcome("bad_input", f"the worker rejected its input: {line}")
    if finding is not None:
        return Outcome("failure", f"{finding.kind}: {finding.reason}")
    rc = -signal.SIGKILL if returncode is None else returncode
    return classify_exit(rc, done=done, stopping=stopping, stepped=stepped, said_hello=said_hello)


def said_why(outcome: Outcome, error: str | None) -> Outcome:
    """A run known to have diverged by its exit status alone (the ranks' word lost): their
    error line, when there is one, is the guard's own."""
    if outcome.kind == "diverged" and outcome.detail == DIVERGED_EXIT and error:
        return Outcome("diverged", error)
    return outcome

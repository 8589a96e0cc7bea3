"""What an attempt's events say (their fields, from what the attempt saw), and the ranks' last
output lines on the console when it fails. Pure but for `show_tail`."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import IO, Any

from supervisor.launch.processes import Exit
from supervisor.policy import exits, nodes
from supervisor.policy.exits import Outcome
from supervisor.policy.liveness import Finding
from supervisor.policy.restarts import AttemptRecord
from supervisor.watch.rank_table import AttemptTable

TAIL_LINES = 15  # rank output shown when an attempt fails


def finding_fields(finding: Finding, detected: float, **extra: Any) -> dict[str, Any]:
    """A finding's event (named for its kind): the ranks, why, and how late it was found."""
    return {
        "ranks": list(finding.ranks),
        "reason": finding.reason,
        "phase": finding.phase,
        "step": finding.step,
        "deadline_mono": round(finding.deadline, 6),
        "detected_mono": round(detected, 6),
        "latency_s": round(detected - finding.deadline, 6),
        **({"node": finding.node} if finding.node else {}),
        **extra,
    }


def exit_fields(info: Exit, table: AttemptTable, **extra: Any) -> dict[str, Any]:
    """The launcher's `exit`, with what the ranks had said by then."""
    return {
        "returncode": info.returncode,
        "status": exits.describe_returncode(info.returncode),
        "rank": info.rank,
        "exit_mono": round(info.mono, 6),
        "step": table.max_step,
        "said_done": bool(table.done_ranks),
        **extra,
    }


def end_fields(
    outcome: Outcome,
    finding: Finding | None,
    record: AttemptRecord,
    table: AttemptTable,
    error: str | None,
    blame: nodes.Attribution | None,
) -> dict[str, Any]:
    """The `attempt_end` event: the outcome, what detected it, where the job resumes from."""
    mem = table.mem_complete
    detected_by = finding.kind if finding else ("stop" if outcome.kind == "stopped" else "exit")
    if outcome.kind == "diverged":  # the ranks' own guard said so, whatever was seen first
        detected_by = "guard"
    return {
        "outcome": outcome.kind,
        "detail": outcome.detail,
        "detected_by": detected_by,
        "resume_step": record.resume_step,
        **({"resume_source": table.resume_source} if table.resume_source else {}),
        "max_step": record.max_step,
        "ckpt_complete": table.ckpt_complete,
        **({"mem_complete": mem} if mem is not None else {}),
        "stale_messages": table.stale,
        "error": error,
        **({"node": blame.node, "attributed": blame.as_dict()} if blame else {}),
    }


def show_tail(console: IO[str] | None, attempt: int, tail: Sequence[str]) -> None:
    """The ranks' last output lines, on the console (MPICH's banner of a bad termination folded
    into one line: output.log keeps it whole)."""
    lines = fold_banners(list(tail))[-TAIL_LINES:]
    if console is None or not lines:
        return
    console.write(f"--- last {len(lines)} lines of attempts/{attempt:03d}/output.log ---\n")
    for line in lines:
        console.write(f"    {line}\n")
    console.flush()


# MPICH Hydra's banner when a process ends badly (every injected kill): 10 lines, 4 of them rules.
_RULE = re.compile(r"^={20,}$")
_BANNER_FACTS = re.compile(r"^=\s+(PID \d+ RUNNING AT \S+|EXIT CODE: -?\d+|KILLED BY SIGNAL: .+)$")
_BANNER_TAIL = re.compile(
    r"^(YOUR APPLICATION TERMINATED WITH THE EXIT STRING: (?P<why>.+)|"
    r"This typically refers to a problem with your application\.|"
    r"Please see the FAQ page for debugging suggestions)$"
)


def fold_banners(lines: list[str]) -> list[str]:
    """Pure: each BAD TERMINATION banner of MPICH Hydra in `lines` as one line that keeps its
    facts (`[mpiexec] BAD TERMINATION: PID 3775 RUNNING AT n1, EXIT CODE: 9, Killed (signal
    9); the banner whole in output.log`), the blank line before it dropped. Anything else, and
    a banner not seen from its first rule, is left as it is."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        j = _banner_end(lines, i)
        if j is None:
            out.append(lines[i])
            i += 1
            continue
        facts = [m.group(1) for line in lines[i:j] if (m := _BANNER_FACTS.match(line.strip()))]
        why = [m.group("why") for line in lines[i:j] if (m := _BANNER_TAIL.match(line.strip()))]
        if out and not out[-1].strip():
            out.pop()
        said = ", ".join([*facts, *[w for w in why if w]])
        out.append(f"[mpiexec] BAD TERMINATION: {said}; the banner whole in output.log")
        i = j
    return out


def _banner_end(lines: list[str], i: int) -> int | None:
    """The index past the banner starting at `lines[i]`, or None when none starts there."""
    if not _RULE.match(lines[i].strip()) or i + 1 >= len(lines):
        return None
    if "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES" not in lines[i + 1]:
        return None
    j = i + 2
    while j < len(lines) and not _RULE.match(lines[j].strip()):
        j += 1
    j += 1  # the closing rule
    while j < len(lines) and _BANNER_TAIL.match(lines[j].strip()):
        j += 1
    return min(j, len(lines))

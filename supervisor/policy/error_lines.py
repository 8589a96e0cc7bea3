"""The one line that says what went wrong in an attempt, read from the ranks' errors and the
launcher's output, and whether it is an error no relaunch can fix. Two attempts that fail alike
give the same line, so the restart policy can tell a repeated failure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence


def error_of(rank_errors: Mapping[int, str], tail: Sequence[str]) -> str | None:
    """One line that says what went wrong: the lowest rank's own error (its last line: a
    traceback ends with the exception), else the last line of output that reads like an error
    and is no warning (`is_warning`: the rank went on after it, so it did not end the attempt).
    Two attempts that fail alike give the same line (no pids or times in it)."""
    if rank_errors:  # a rank's own error before a survivor's word that its peer is gone
        own = [r for r, m in rank_errors.items() if not peer_lost(m)] or list(rank_errors)
        message = rank_errors[min(own)].strip().splitlines()
        return message[-1][:MAX_ERROR_CHARS] if message else None
    found = None
    after_warning = False  # the indented lines below a Python warning are part of it
    for line in tail:
        raw = _RANK_PREFIX.sub("", line)
        text = raw.strip()
        if is_warning(text):
            after_warning = _PY_WARNING.match(text) is not None
            continue
        if after_warning and raw[:1].isspace():
            continue
        after_warning = False
        if _ERRORISH.search(text):
            found = text
    return found[:MAX_ERROR_CHARS] if found is not None else None


def peer_lost(message: str) -> bool:
    """A rank's error that says only that another rank is gone (gloo's "Connection closed by
    peer", a reset, a broken pipe): what a survivor of another rank's failure reports, no fault
    of its own."""
    return _PEER_LOST.search(message) is not None


def is_warning(line: str) -> bool:
    """A line of output that is a warning, not an error: the worker's `WARNING: …` (the memory
    tier off, a checkpoint skipped or failed while training goes on), a Python warning
    (`file.py:12: UserWarning: …`) or a c10 one (`[W1203 12:00:00 socket.cpp:663] …`)."""
    return _WARNING.match(line) is not None


def unfixable(error: str | None) -> str | None:
    """An error that no relaunch on these nodes can fix, said as the job's end: a host that
    does not resolve, a checkpoint or stage dir that is full or read-only (the worker's line)."""
    if not error:
        return None
    match = _UNRESOLVED_HOST.search(error)
    if match:
        return f"the launcher cannot start: host {match.group(1)!r} does not resolve ({error})"
    if _STORAGE_FULL.match(error):
        return error
    return None


def allocation_gone(error: str | None) -> str | None:
    """The batch allocation the launches ran in is over (srun says so): no relaunch can start,
    said as the job's end with what ends one, instead of relaunches until no progress."""
    if not error or not _ALLOCATION_GONE.search(error):
        return None
    return (
        f"the Slurm allocation is gone ({error}): scancel, its time limit, or a failed node "
        "without sbatch/salloc --no-kill ends it; continue the job in a new allocation"
    )


MAX_ERROR_CHARS = 300
_RANK_PREFIX = re.compile(r"^\[\d+\]\s?")
_ERRORISH = re.compile(r"error|exception|could not|cannot|failed|denied|not found", re.I)
_PY_WARNING = re.compile(r"\S.*:\d+: \w*Warning: ")
_WARNING = re.compile(rf"warn(?:ing)?\b|\[W[\d ]|{_PY_WARNING.pattern}", re.I)
_PEER_LOST = re.compile(
    r"connection (reset|closed) by peer|broken pipe|remote process exited|peer .*(closed|died)",
    re.IGNORECASE,
)
_UNRESOLVED_HOST = re.compile(r"[Cc]ould not resolve hostname ([^\s:]+)")
_ALLOCATION_GONE = re.compile(
    r"Slurm job \d+ has expired|[Jj]ob allocation \d+ has been revoked|"
    r"Job/step already completing or completed|Invalid job id specified"
)
_STORAGE_FULL = re.compile(r"(disk full|disk quota exceeded|read-only file system): ")

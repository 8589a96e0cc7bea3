"""Fence records: the attempts the supervisor has ended, and from when nothing they write counts.

When the supervisor ends an attempt (its ranks failed, hung, or went out of reach) it stops
renewing their leases (worker.lease) and writes `<ckpt-dir>/.fences/<job>-<attempt>.json`
before anything resumes. A rank cut off from the supervisor may still write until its lease
runs out: a checkpoint marker, a memory or partner copy. Each of those names its writer (job,
attempt, lease epoch: `ckpt_files.writer_of`) and its `saved_at` time, so a resume refuses what a
fenced attempt wrote after its fence (`late`), and the sweep removes it.

Times are wall-clock times of different hosts: like the lease, this takes the hosts' clocks to
agree to well under the seconds between a fence and the first resume (NTP keeps them within
milliseconds). JSON only, and a file that is not a fence record is ignored.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts import ckpt_files

DIR = ".fences"
MAX_RECORD_BYTES = 4096
MAX_RECORDS = 10_000  # read at most this many (a job fails far fewer times)
_RECORD_NAME = re.compile(r"^[^.].*-\d+\.json$")  # `<job>-<attempt>.json`


@dataclass(frozen=True)
class Fence:
    job: str
    attempt: int
    at: float  # wall time: what the attempt wrote after this is never used
    why: str


def path_of(root: Path, job: str, attempt: int) -> Path:
    return root / DIR / f"{job}-{attempt}.json"


def write(root: Path, fence: Fence) -> None:
    """The record, atomically (a reader sees all of it or nothing); an attempt's first fence
    stands (a later one would let through what was written in between). Something at its path
    that is not a record (junk, a directory) is no fence: it is replaced, or this raises."""
    path = path_of(root, fence.job, fence.attempt)
    if _parse(path) is not None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    ckpt_files.write_atomic(path, json.dumps(fence.__dict__).encode())


def read_all(root: Path) -> dict[tuple[str, int], Fence]:
    """Every fence record under `root`, by (job, attempt); none when there is no `.fences`.
    Only files named as records are read (at most MAX_RECORDS)."""
    found: dict[tuple[str, int], Fence] = {}
    try:
        with os.scandir(root / DIR) as entries:
            names = [e.name for e in entries if _RECORD_NAME.match(e.name)]
    except OSError:
        return found
    for name in names[:MAX_RECORDS]:
        fence = _parse(root / DIR / name)
        if fence is not None:
            found[(fence.job, fence.attempt)] = fence
    return found


def after(fenced: dict[tuple[str, int], Fence], job: str) -> int:
    """Pure: the first attempt number no fence record of `job` names (0 when none does)."""
    return max((attempt + 1 for j, attempt in fenced if j == job), default=0)


def _parse(path: Path) -> Fence | None:
    """The record at `path`; None for anything else. Read without blocking and at most
    MAX_RECORD_BYTES: a FIFO or a device named like a record must not hang a reader."""
    if path.name.startswith("."):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            raw = os.read(fd, MAX_RECORD_BYTES + 1)
        finally:
            os.close(fd)
        data = json.loads(raw) if len(raw) <= MAX_RECORD_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    return record(data, path.name)


def record(data: Any, name: str) -> Fence | None:
    """Pure: the fence a parsed record holds, when each field has its type (`at` a finite
    time) and the file's `name` is its own; None otherwise (a copy under another name, junk)."""
    if not isinstance(data, dict):
        return None
    job, attempt, at, why = (data.get(k) for k in ("job", "attempt", "at", "why"))
    if not (isinstance(job, str) and _attempt(attempt) is not None and isinstance(why, str)):
        return None
    at = written_at(at)
    if at is None or name != path_of(Path(), job, attempt).name:
        return None
    return Fence(job, attempt, at, why)


def _attempt(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def written_at(value: Any) -> float | None:
    """Pure: a record's time as a number; None when it is none (missing, text, a bool, NaN,
    infinite, an integer beyond a float): when such a record was written cannot be told."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        at = float(value)
    except OverflowError:  # JSON's integers have no bound
        return None
    return at if math.isfinite(at) else None


def late(writer: Any, saved_at: Any, fences: dict[tuple[str, int], Fence]) -> str | None:
    """Pure: why a checkpoint or copy with this `writer` record and `saved_at` time is refused
    (written by a fenced attempt after its fence, or at no time it says); None when it may be
    used. A `writer` that is not a writer's record (of no job and attempt) names no attempt."""
    if not fences or not isinstance(writer, dict):
        return None
    job, attempt = writer.get("job"), _attempt(writer.get("attempt"))
    fence = fences.get((job, attempt)) if isinstance(job, str) and attempt is not None else None
    if fence is None:
        return None
    at = written_at(saved_at)
    if at is not None and at <= fence.at:
        return None
    when = "after" if at is not None else f"at no time it says (saved_at {saved_at!r}), maybe after"
    return (
        f"written by attempt {fence.attempt} {when} the supervisor fenced it "
        f"({fence.why}); never used"
    )


def _step_record(directory: Path) -> dict[str, Any] | None:
    """A step dir's `meta.json` as an object; None when it cannot be read as one (what
    verifies a checkpoint says so)."""
    try:
        meta = ckpt_files.read_meta(directory)
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested deep
        return None
    return meta if isinstance(meta, dict) else None


def late_step(directory: Path, fenced: dict[tuple[str, int], Fence]) -> str | None:
    """Why the checkpoint in a step dir is refused for its writer (`late`, from its
    `meta.json`); None when it is not, or when that record cannot be read."""
    meta = _step_record(directory) if fenced else None
    return None if meta is None else late(meta.get("writer"), meta.get("saved_at"), fenced)


def removable(writer: Any, saved_at: Any, fences: dict[tuple[str, int], Fence]) -> bool:
    """Pure: `late`, and known to be (its `saved_at` a time after the fence): only that is
    removed. One of no known time is refused but kept (it may be a good one, damaged)."""
    return late(writer, saved_at, fences) is not None and written_at(saved_at) is not None


def discard(directory: Path, fenced: dict[tuple[str, int], Fence]) -> str | None:
    """Remove a step dir that a fenced attempt is known to have written after its fence
    (`removable`, from its `meta.json`): None when removed; else why it is kept ("" when it is
    not known to be late: not late, of no known time, or with no record to tell)."""
    meta = _step_record(directory)
    if meta is None or not removable(meta.get("writer"), meta.get("saved_at"), fenced):
        return ""
    try:
        ckpt_files.remove_step_dir(directory)
    except OSError as exc:
        return f"it cannot be removed: {exc.strerror or exc}"
    return None


def sweep(root: Path) -> list[int]:
    """Remove every step dir under `root` that a fenced attempt wrote after its fence (its
    `meta.json` says so); the steps removed. Nothing is read when no attempt is fenced. Never
    raises for what it finds: one it cannot read or remove is left (a resume refuses it)."""
    fenced = read_all(root)
    try:
        found = ckpt_files.scan(root) if fenced else []
    except OSError:
        return []
    return [f.step for f in found if discard(f.path, fenced) is None]

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
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts import ckpt_files

DIR = ".fences"
MAX_RECORD_BYTES = 4096
MAX_RECORDS = 10_000  # read at most this many (a job fails far fewer times)


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
    stands (a later one would let through what was written in between)."""
    path = path_of(root, fence.job, fence.attempt)
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    ckpt_files.write_atomic(path, json.dumps(fence.__dict__).encode())


def read_all(root: Path) -> dict[tuple[str, int], Fence]:
    """Every fence record under `root`, by (job, attempt); none when there is no `.fences`."""
    found: dict[tuple[str, int], Fence] = {}
    try:
        entries = list(os.scandir(root / DIR))[:MAX_RECORDS]
    except OSError:
        return found
    for entry in entries:
        fence = _parse(Path(entry.path))
        if fence is not None:
            found[(fence.job, fence.attempt)] = fence
    return found


def _parse(path: Path) -> Fence | None:
    try:
        if path.name.startswith(".") or path.stat().st_size > MAX_RECORD_BYTES:
            return None
        data = json.loads(path.read_bytes())
        fence = Fence(str(data["job"]), int(data["attempt"]), float(data["at"]), str(data["why"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return fence


def late(writer: Any, saved_at: Any, fences: dict[tuple[str, int], Fence]) -> str | None:
    """Pure: why a checkpoint or copy with this `writer` record and `saved_at` time is refused
    (written by a fenced attempt after its fence); None when it may be used."""
    if not fences or not isinstance(writer, dict):
        return None
    fence = fences.get((writer.get("job"), writer.get("attempt")))
    if fence is None:
        return None
    if isinstance(saved_at, (int, float)) and saved_at <= fence.at:
        return None
    return (
        f"written by attempt {fence.attempt} after the supervisor fenced it "
        f"({fence.why}); never used"
    )


def sweep(root: Path) -> list[int]:
    """Remove every step dir under `root` that a fenced attempt wrote after its fence (its
    `meta.json` says so); the steps removed. Nothing is read when no attempt is fenced."""
    fenced = read_all(root)
    removed = []
    for found in ckpt_files.scan(root) if fenced else []:
        try:
            meta = ckpt_files.read_meta(found.path)
        except (OSError, ValueError):
            continue  # no record (a save cut short): retention's
        if isinstance(meta, dict) and late(meta.get("writer"), meta.get("saved_at"), fenced):
            ckpt_files.remove_step_dir(found.path)
            removed.append(found.step)
    return removed

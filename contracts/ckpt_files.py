"""The durable checkpoint directory's layout: `ckpt-dir/step-<N>/`, done once `.complete` is
in it; scanning, verifying, marking and retention.

Defined once here for every reader and writer of a checkpoint directory: the worker, the
supervisor's `status` and faults/ (which gate on a marker or damage the newest checkpoint).
No torch. Decisions (which checkpoint is newest, what retention deletes, whether a step
directory's files match its record) are pure functions over what a scan found.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts import env_names

STEP_PREFIX = "step-"
MARKER = ".complete"  # written last, atomically: the checkpoint counts only once it exists
META = "meta.json"
_STEP_NAME = re.compile(rf"^{STEP_PREFIX}(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"{STEP_PREFIX}{step}"


def marker(root: Path, step: int) -> Path:
    return step_dir(root, step) / MARKER


def parse_step(name: str) -> int | None:
    """The step of a `step-N` directory name; None for any other name."""
    match = _STEP_NAME.match(name)
    return int(match.group(1)) if match else None


def is_complete(directory: Path) -> bool:
    return (directory / MARKER).is_file()


def job_tag(ckpt_dir: str, job_id: str | None) -> str:
    """What names a job's node-local scratch (async stage dir, memory tier): the job id when
    the supervisor gave one, else a hash of the durable dir (two jobs on a node never share)."""
    return job_id or hashlib.sha1(str(Path(ckpt_dir).resolve()).encode()).hexdigest()[:12]


def writer_of(env: Mapping[str, str], lease_epoch: int) -> dict[str, Any]:
    """Who writes a checkpoint or a memory copy, recorded in it: the job and attempt (from the
    supervisor's `ES_JOB_ID`/`ES_ATTEMPT`; empty without one) and the lease epoch the rank held.
    A resume refuses what a fenced attempt wrote after its fence (`fenced_out`)."""
    job = env.get(env_names.ENV_JOB_ID, "")
    try:
        attempt = int(env.get(env_names.ENV_ATTEMPT, "-1"))
    except ValueError:
        attempt = -1
    return {"job": job, "attempt": attempt, "lease_epoch": lease_epoch} if job else {}


SET_ASIDE = ".set-aside-"  # a reused step dir's old contents, awaiting deletion
CRC_CHUNK = 8 << 20


@dataclass(frozen=True)
class Found:
    step: int
    path: Path
    complete: bool


def scan(root: Path) -> list[Found]:
    """Every step-N directory under root, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = parse_step(entry.name)
        if step is not None and entry.is_dir():
            found.append(Found(step, entry, is_complete(entry)))
    return sorted(found, key=lambda f: f.step)


def resume_candidates(found: list[Found]) -> list[Found]:
    """Complete checkpoints, newest first: the order in which resume tries them."""
    return [f for f in reversed(found) if f.complete]


def retention_plan(found: list[Found], keep: int) -> list[Found]:
    """What to delete: complete checkpoints beyond the newest `keep`, and incomplete ones older
    than the newest complete (a newer incomplete one may be a save in flight). Never the newest
    complete checkpoint."""
    complete = [f for f in found if f.complete]
    if not complete:
        return []
    newest = complete[-1]
    doomed = complete[: -max(keep, 1)]
    doomed += [f for f in found if not f.complete and f.step < newest.step]
    return sorted(doomed, key=lambda f: f.step)


def file_crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def record_files(directory: Path, crcs: dict[str, int] | None = None) -> dict[str, dict]:
    """Name -> size (and crc32) of every data file in a step directory."""
    files = {}
    for entry in sorted(directory.iterdir()):
        if entry.name in (MARKER, META) or entry.name.startswith(".tmp") or not entry.is_file():
            continue
        files[entry.name] = {"size": entry.stat().st_size}
        if crcs is not None and entry.name in crcs:
            files[entry.name]["crc32"] = crcs[entry.name]
    return files


def verify_problem(directory: Path, files: dict[str, dict], check_crc: bool = True) -> str | None:
    """None when every recorded file is there with its size (and checksum); else what failed."""
    for name, want in files.items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{path} has {size} bytes, {want['size']} recorded"
        if check_crc and "crc32" in want and file_crc(path) != want["crc32"]:
            return f"{path} fails its checksum"
    return None


def read_meta(directory: Path) -> dict:
    return json.loads((directory / META).read_text())


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Temp file, fsync, rename, fsync of the directory: after a crash the file is either
    absent or whole."""
    tmp = path.with_name(f".tmp-{path.name}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def prepare_step_dir(directory: Path, sync_parent: bool = True) -> None:
    """Empty a reused step directory, marker first, so a stale `.complete` can never vouch for
    half-written new shards. The old contents are renamed aside (one metadata operation,
    however large they are) and deleted later by `remove_set_aside`, after the next marker.
    `sync_parent=False` leaves the fsync of the new directory's entry to the caller (the async
    path does it in the background, before the marker)."""
    marker = directory / MARKER
    if marker.exists():
        marker.unlink()
        fsync_dir(directory)
    if directory.exists():
        directory.rename(directory.with_name(f"{SET_ASIDE}{directory.name}-{uuid.uuid4().hex}"))
    directory.mkdir(parents=True)
    if sync_parent:
        fsync_dir(directory.parent)


def remove_set_aside(root: Path) -> None:
    """Delete what `prepare_step_dir` set aside (also after a crash left some behind)."""
    for path in root.glob(f"{SET_ASIDE}*"):
        shutil.rmtree(path, ignore_errors=True)


def mark_complete(directory: Path, meta: dict) -> None:
    write_atomic(directory / META, json.dumps(meta, indent=1).encode())
    write_atomic(directory / MARKER, b"")


def remove(found: list[Found]) -> None:
    for f in found:
        remove_step_dir(f.path)


def remove_step_dir(directory: Path) -> None:
    # The marker goes first: a half-deleted directory must not look complete.
    (directory / MARKER).unlink(missing_ok=True)
    shutil.rmtree(directory, ignore_errors=True)

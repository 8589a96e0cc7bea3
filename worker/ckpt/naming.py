"""Where a durable checkpoint lives: `ckpt-dir/step-<N>/`, done once `.complete` is in it.

Defined once here for every reader of a checkpoint directory: the worker, the supervisor's
`status` and faults/ (which gate on a marker or damage the newest checkpoint). No torch, no I/O
beyond a stat.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

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

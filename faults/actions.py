"""What a fault does to the ranks and their checkpoints: the impure half of faults/.

- Signals: a rank on this host is signalled by its pid (from its `hello`); the others get a
  command on the control channel and signal themselves (`faults.delivery`).
- Checkpoint damage: `corrupt` truncates (or flips bytes in) one shard of the newest complete
  checkpoint, `unmark` removes its `.complete`; the fault then kills the ranks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contracts import ckpt_files

FLIP_BYTES = 64


def send_signal(pid: int, signum: int) -> str | None:
    """Signal a local rank; None when delivered, else why not."""
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        return f"pid {pid} is gone"
    except PermissionError:
        return f"no permission to signal pid {pid}"
    return None


@dataclass(frozen=True)
class Damage:
    """What `corrupt` or `unmark` did to the newest complete checkpoint."""

    step: int
    path: str
    how: str  # truncate | flip | unmark
    file: str = ""
    bytes_before: int = 0
    bytes_after: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def newest_complete(ckpt_dir: Path) -> ckpt_files.Found | None:
    found = ckpt_files.resume_candidates(ckpt_files.scan(ckpt_dir))
    return found[0] if found else None


def corrupt(ckpt_dir: Path, mode: str, rank: int) -> Damage | None:
    """Damage one shard (the target rank's, else the first) so the checkpoint fails to verify."""
    newest = newest_complete(ckpt_dir)
    if newest is None:
        return None
    shards = sorted(newest.path.glob("*.distcp"))
    mine = newest.path / f"__{rank}_0.distcp"
    shard = mine if mine in shards else (shards[0] if shards else None)
    if shard is None:
        return None
    size = shard.stat().st_size
    if mode == "truncate":
        os.truncate(shard, size // 2)
        after = size // 2
    else:
        with open(shard, "r+b") as f:
            f.seek(max(0, size // 2 - FLIP_BYTES // 2))
            data = f.read(FLIP_BYTES)
            f.seek(-len(data), os.SEEK_CUR)
            f.write(bytes(b ^ 0xFF for b in data))
            f.flush()
            os.fsync(f.fileno())
        after = size
    return Damage(newest.step, str(newest.path), mode, shard.name, size, after)


def unmark(ckpt_dir: Path) -> Damage | None:
    """Remove the newest `.complete`: that checkpoint no longer counts for resume."""
    newest = newest_complete(ckpt_dir)
    if newest is None:
        return None
    (newest.path / ckpt_files.MARKER).unlink(missing_ok=True)
    ckpt_files.fsync_dir(newest.path)
    return Damage(newest.step, str(newest.path), "unmark")


def remove_tree(path: str) -> bool:
    """Remove a directory and all under it (a lost node's memory root); whether it is gone."""
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def now_pair() -> tuple[float, float]:
    """(wall, monotonic) read together: a fault's time in both clocks."""
    return time.time(), time.monotonic()

"""A save that failed because its storage is full or read-only, said in one line.

Retrying cannot help (every attempt fails the same save), and DCP's own report of it is a
multi-kilobyte traceback from every rank. The training loop turns it into a usage error
(exit 2): one line naming the directory and the step, the partial save removed at once.
No torch here.
"""

from __future__ import annotations

import errno
from pathlib import Path

from worker.errors import UsageError

STORAGE_ERRORS = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
}


class StorageFull(UsageError):
    """A save's storage is full or read-only: `disk full: ckpt-dir … at the save of step N`."""


def storage_error(exc: BaseException) -> OSError | None:
    """The full-or-read-only OSError behind `exc`, wherever it hides: chained, or one rank's
    failure inside DCP's CheckpointException (`failures`: rank -> (exception, stack))."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRORS:
            return e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def storage_failure(exc: BaseException, ckpt_dir: Path, step: int) -> StorageFull | None:
    """The one-line error for a save of `step` that `exc` ended, if its storage was full."""
    err = storage_error(exc)
    if err is None:
        return None
    where = f"ckpt-dir {ckpt_dir}"
    if err.filename and not _under(Path(err.filename), ckpt_dir):
        where = f"{Path(err.filename).parent} (stage dir)"
    return StorageFull(
        f"{STORAGE_ERRORS[err.errno]}: {where} at the save of step {step} "
        f"({err.strerror}); free space there or choose another directory"
    )


def _under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True

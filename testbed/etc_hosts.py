"""The machine's own /etc/hosts: the supervisor on the head node resolves the hosts by name, so
`up` adds a block between marker lines and `down` removes exactly that block. The file is
rewritten in place (it may be a bind mount, which a rename would not replace), under a lock, and
every line outside the block is kept as it was."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

from testbed.layout import HOSTS_FILE, BedPlan, with_block, without_block


def rewrite(change: Callable[[str], str], path: Path = HOSTS_FILE) -> None:
    with open(path, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        old = f.read()
        new = change(old)
        if new != old:
            f.seek(0)
            f.write(new)
            f.truncate()
            f.flush()
            os.fsync(f.fileno())


def add(bed: BedPlan, path: Path = HOSTS_FILE) -> None:
    rewrite(lambda text: with_block(text, bed), path)


def remove(path: Path = HOSTS_FILE) -> None:
    rewrite(without_block, path)

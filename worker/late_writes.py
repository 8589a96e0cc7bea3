"""A cut-off rank that keeps saving (`ES_INJECT` point `write_when_cut_s`): the test of fencing.

Once no lease renewal has reached the armed rank for that many seconds (its node cut off, or its
supervisor gone) it writes a checkpoint into the durable dir every `EVERY_S`: a copy of the newest
complete one under a step far ahead (`AHEAD` + its count), with its own `writer` and `saved_at`,
its marker written through the lease's gate as every marker is, until its lease stops it. What a
split-brain rank would leave: complete, verifiable, the newest by step, so a resume that did not
refuse it would take it (docs/architecture.md, "Fencing").
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

from contracts import ckpt_files
from worker import lease

AHEAD = 100_000  # far beyond any test's last step: a resume from one is plain to see
EVERY_S = 0.2


_started = threading.Event()


def start(root: Path, quiet_s: float) -> None:
    """Start the writer on a thread of its own (daemon: it ends with the process), once; called
    at the rank's first step (a standby or a prepared rank, which never trained, writes none)."""
    if _started.is_set():
        return
    _started.set()
    thread = threading.Thread(target=_write, args=(root, quiet_s), name="es-late-writes")
    thread.daemon = True
    thread.start()


def _write(root: Path, quiet_s: float) -> None:
    count = 0
    while True:
        time.sleep(EVERY_S)
        held = lease.LEASE
        left = held.left_s()
        if left is None or held.seconds - left < quiet_s:
            continue  # no lease, or renewed lately: not cut off
        newest = ckpt_files.resume_candidates(ckpt_files.scan(root))
        newest = [f for f in newest if f.step < AHEAD]
        if not newest:
            continue
        count += 1
        _copy(newest[0].path, ckpt_files.step_dir(root, AHEAD + count))


def _copy(source: Path, target: Path) -> None:
    tmp = target.with_name(f".tmp-late-{target.name}")
    try:
        shutil.copytree(source, tmp, ignore=shutil.ignore_patterns(ckpt_files.MARKER))
        meta = ckpt_files.read_meta(tmp)
        tmp.rename(target)
    except (OSError, ValueError):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    meta.update(
        step=int(target.name.removeprefix(ckpt_files.STEP_PREFIX)),
        saved_at=time.time(),
        writer=ckpt_files.writer_of(os.environ, lease.epoch()),
    )
    lease.guard()  # as every marker: none once fenced
    ckpt_files.mark_complete(target, meta)

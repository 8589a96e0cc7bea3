"""A rank's own Python stacks, on the supervisor's signal (`stack_files.STACKS_SIGNAL`, SIGUSR2).

`install` registers faulthandler for the signal early in the rank's life: the dump of every
thread is written by faulthandler's C handler, so it comes even while the main thread is blocked
in C (a collective, I/O) or runs a loop, and needs neither the GIL nor the main thread.

Under the supervisor (`ES_ATTEMPT_DIR` set) the dump goes into a pipe, and a small thread copies
it to `ES_ATTEMPT_DIR/stacks/rank-<R>.txt` (written whole: temp file, then rename), so no file is
created, and no file descriptor held on the shared file system, unless a dump is asked for.
Without the supervisor, `kill -USR2 <pid>` writes the stacks to stderr.

No torch here: train.py installs this before the slow imports.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Mapping

from contracts import env_names, stack_files

PIPE_BYTES = 1 << 20  # room for one dump of many threads without the handler's writes failing
QUIET_S = 0.05  # a dump is over when the pipe stayed empty this long
MAX_DUMP_BYTES = 4 << 20

_installed: str | None = None  # where dumps go: a path, "stderr", or None (not installed)


def installed() -> bool:
    """Whether this process dumps its stacks on STACKS_SIGNAL (a control-channel `signal` of it
    must not reach a process without the handler: the signal's default action ends it)."""
    return _installed is not None


def install(env: Mapping[str, str], rank: int) -> str:
    """Register the handler; return where dumps go ("" when it cannot be: the rank trains all
    the same, and the supervisor reads it from outside)."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        _installed = _install(env, rank)
    except (OSError, RuntimeError, ValueError, AttributeError):  # no stderr, no pipe, no thread
        return ""
    return _installed


def _install(env: Mapping[str, str], rank: int) -> str:
    attempt_dir = env.get(env_names.ENV_ATTEMPT_DIR)
    if not attempt_dir:
        faulthandler.register(stack_files.STACKS_SIGNAL, file=sys.stderr, all_threads=True)
        return "stderr"
    read_fd, write_fd = os.pipe()  # neither is inherited by a program this rank may exec
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    # A full pipe loses the rest of a dump instead of blocking the rank inside the handler.
    os.set_blocking(write_fd, False)
    faulthandler.register(stack_files.STACKS_SIGNAL, file=write_fd, all_threads=True, chain=False)
    path = stack_files.stacks_path(attempt_dir, rank)
    header = f"# rank {rank} (pid {os.getpid()} on {socket.gethostname()}): its own dump"
    try:
        threading.Thread(
            target=_copy_dumps, args=(read_fd, path, header), name="es-stacks", daemon=True
        ).start()
    except RuntimeError:
        faulthandler.unregister(stack_files.STACKS_SIGNAL)
        raise
    return path


def _copy_dumps(read_fd: int, path: str, header: str) -> None:
    """Forever: wait for a dump in the pipe, then write it to `path` whole."""
    while True:
        try:
            data = _read_dump(read_fd)
        except OSError:
            return
        if not data:
            return
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime())
        text = (
            f"{header} (faulthandler, all threads, on {stack_files.STACKS_SIGNAL.name})"
            f" at {stamp}\n\n"
        ).encode() + data
        with contextlib.suppress(OSError):  # a full or read-only run dir: nothing to be done
            _write_whole(path, text)


def _read_dump(fd: int) -> bytes:
    """One dump: block for its first bytes, then read until the pipe stays quiet."""
    chunks = [os.read(fd, 65536)]
    if not chunks[0]:
        return b""
    size = len(chunks[0])
    while size < MAX_DUMP_BYTES:
        ready, _, _ = select.select([fd], [], [], QUIET_S)
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _write_whole(path: str, data: bytes) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

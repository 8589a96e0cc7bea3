"""The supervisor's console may vanish while a job runs: a closed terminal or an SSH drop (SIGHUP,
then EIO on every write to the terminal), or a reader that went away (EPIPE: `run … | head`).

The job must end as it would have (a graceful stop, its events, its scratch removed, its report
written), so a write to the console never fails: `guard` wraps stdout and stderr, and from the
first failed write or flush on one of them, that stream goes to /dev/null (what Python still
holds for it, and its own flush at exit, included). events.jsonl keeps the record.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any


class Guarded:
    """A text stream whose writes and flushes never raise: on the first OSError its file
    descriptor is pointed at /dev/null (`gone` says why)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.gone: str | None = None

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError) as exc:
            self._lost(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError) as exc:
            self._lost(exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def _lost(self, exc: Exception) -> None:
        if self.gone is not None:
            return
        self.gone = str(exc) or type(exc).__name__
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self._stream.fileno())
            finally:
                os.close(null)
        with contextlib.suppress(OSError, ValueError):
            self._stream.flush()  # what was held for the dead console: to /dev/null now


def guard() -> None:
    """From now on, stdout and stderr never raise on a write or a flush."""
    if not isinstance(sys.stdout, Guarded) and sys.stdout is not None:
        sys.stdout = Guarded(sys.stdout)
    if not isinstance(sys.stderr, Guarded) and sys.stderr is not None:
        sys.stderr = Guarded(sys.stderr)

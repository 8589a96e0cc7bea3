"""This process's lease: what fences a rank the supervisor can no longer reach (`ES_LEASE_S`).

The supervisor renews the lease of every rank it keeps (running, standby, prepared) with a
signed `lease` command on the control channel, every few seconds, until a wall-clock time
(`until`). A rank whose lease ran out stops at once: no step, no save, no fan-out, no marker, no
memory or partner copy after that moment; the process SIGKILLs itself, threads and all. That
covers a rank cut off from the supervisor by a partition and a supervisor that died: either way
no renewal comes (docs/architecture.md, "Fencing").

Wall time, not the monotonic clock: a renewal that sat queued through a partition arrives with
its old `until` and extends nothing. The clock starts when the rank's beacon starts (not at its
launch), so slow imports never fence a rank before it could hear a renewal.

A leaf (no torch, nothing of the training loop): worker/ckpt/ calls `guard()` before each write.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

from contracts import env_names


class Lease:
    """Until when this process may write (wall time); None: no lease (unsupervised, or off)."""

    def __init__(self) -> None:
        self.until: float | None = None
        self.epoch = 0  # the newest renewal's number (the supervisor's count)
        self.seconds = 0.0
        self.end_with: int | None = None  # a fork template's pid: ended first (worker.template)
        # The newest renewal that came already run out (seconds after its `until`, its epoch):
        # renewals that reach the rank and extend nothing say its clock is ahead.
        self.expired: tuple[float, int] | None = None
        self._lock = threading.Lock()

    def start(self, seconds: float) -> None:
        """The first grant, `seconds` from now (the beacon's start); 0: no lease."""
        with self._lock:
            self.seconds = seconds
            self.until = time.time() + seconds if seconds > 0 else None

    def renew(self, until: float, epoch: int) -> None:
        """A renewal: only ever extends (a stale one, queued through a cut, does nothing)."""
        with self._lock:
            if self.until is None:
                return
            if until > self.until:
                self.until, self.epoch = until, max(self.epoch, epoch)
            if (late := time.time() - until) > 0 and epoch >= self.epoch:
                self.expired = (late, epoch)

    def left_s(self) -> float | None:
        """Seconds until it runs out (negative: it has); None without a lease."""
        until = self.until
        return None if until is None else until - time.time()

    def enforce(self) -> None:
        """Stop this process at once if its lease ran out: nothing it does after this moment
        reaches the job. SIGKILL, not an exit: no handler, no thread, no `finally` writes on."""
        left = self.left_s()
        if left is None or left > 0:
            return
        line = fenced_line(-left, self.epoch, self.expired)
        try:  # never blocks: a cut-off host's output pipe may be full
            os.set_blocking(2, False)
            os.write(2, line.encode())
        except (OSError, ValueError):
            pass
        if self.end_with is not None and os.getppid() == self.end_with:
            with contextlib.suppress(OSError):  # its template ends (and its other ranks with it)
                os.kill(self.end_with, signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGKILL)


def fenced_line(ago: float, epoch: int, expired: tuple[float, int] | None) -> str:
    """Pure: what a fenced rank says. Renewals that came run out (newer than the last that
    counted) mean the supervisor was heard: its host's clock is behind this one's (fencing takes
    them to agree: docs/architecture.md, "Fencing"), or they were held up on the way."""
    why = "unreachable or gone"
    if expired is not None and expired[1] > epoch:
        late, newest = expired
        why = (
            f"its renewals still come but already run out (epoch {newest}, {late:.1f}s after "
            "its until): this host's clock is ahead of the supervisor's (run NTP), or they "
            "are held up"
        )
    return (
        f"fenced: the supervisor's lease ran out {ago:.1f}s ago (epoch {epoch}): {why}; "
        "this rank stops writing and exits\n"
    )


LEASE = Lease()  # one per process


def start_from_env() -> None:
    """Start the lease the supervisor asked for (`ES_LEASE_S`), if any."""
    raw = os.environ.get(env_names.ENV_LEASE_S, "")
    try:
        seconds = float(raw) if raw else 0.0
    except ValueError:
        seconds = 0.0
    if seconds > 0 and LEASE.until is None:
        LEASE.start(seconds)


def guard() -> None:
    """Before a write the job may use (a step, a save, a marker, a copy): stop if fenced."""
    LEASE.enforce()


def epoch() -> int:
    return LEASE.epoch

"""Where a rank's Python stacks are written on a hang or no-progress finding, and the signal
that asks a rank for them.
"""

from __future__ import annotations

import os
import signal

# --- stacks on a hang or no-progress finding ------------------------------------------------------
# Before tearing an attempt down for a `hang` or `no_progress`, the supervisor has each rank's
# Python stacks (all threads) written to `ES_ATTEMPT_DIR/stacks/rank-<R>.txt`: a rank that can still
# run dumps its own on STACKS_SIGNAL (faulthandler, registered at start); one that cannot (stopped,
# in D state) is read from outside. No other part of the job may use this signal.
STACKS_SIGNAL = signal.SIGUSR2
STACKS_DIR = "stacks"


def stacks_path(attempt_dir: str | os.PathLike, rank: int) -> str:
    return os.path.join(attempt_dir, STACKS_DIR, f"rank-{rank}.txt")

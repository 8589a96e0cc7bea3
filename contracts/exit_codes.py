"""Exit statuses: the supervisor's own (documented in `--help` and the README) and the
worker's for bad input and for a run that diverged, which the supervisor reads as "do not
relaunch".
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """The supervisor's own exit status (documented in `--help` and the README)."""

    DONE = 0
    ERROR = 1  # a bug or an unexpected environment failure
    USAGE = 2  # bad config, bad flags, missing launcher, or the worker rejected its input
    BUDGET = 3  # restart budget exhausted
    NO_PROGRESS = 4  # too many attempts in a row completed no newer checkpoint
    INTERRUPTED = 5  # stopped by SIGINT/SIGTERM/SIGHUP (after a graceful stop of the ranks)
    NODES = 6  # too few good nodes left: excluded, no spare, and no shrink (or below min_nodes);
    # or none at all: the batch allocation is gone
    DIVERGED = 7  # the ranks' numerical guard gave up: no relaunch can help the same settings


# A rank that refuses its input (bad flags, impossible layout, an unusable path) exits with this,
# after one line saying why; relaunching cannot help.
WORKER_USAGE = 2
# A run whose numerical guard gave up (bad steps in a row that no skipped batch helped: diverged
# weights, a learning rate that blows them up): one line saying what to change, and this.
WORKER_DIVERGED = 3

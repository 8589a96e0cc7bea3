"""Errors a person fixes by changing the command line or the files it names."""

from contracts.exit_codes import WORKER_USAGE


class UsageError(Exception):
    """Bad flags, impossible layout, missing or unwritable paths: one line, exit 2."""

    exit_code = WORKER_USAGE  # the supervisor does not relaunch on it

"""Errors a person fixes by changing the command line or the files it names."""


class UsageError(Exception):
    """Bad flags, impossible layout, missing or unwritable paths: one line, exit 2."""

    exit_code = 2

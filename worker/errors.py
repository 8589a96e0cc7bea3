"""Errors a person fixes by changing the command line or the files it names."""

from contracts.exit_codes import WORKER_DIVERGED, WORKER_USAGE


class UsageError(Exception):
    """Bad flags, impossible layout, missing or unwritable paths: one line, exit 2."""

    exit_code = WORKER_USAGE  # the supervisor does not relaunch on it
    # The `error` message's `cause` (contracts.messages.ERROR_CAUSES): the supervisor ends the
    # job on the rank's word, whichever of its end or the launcher's status it sees first.
    cause: str | None = "usage"


class Diverged(UsageError):
    """The numerical guard gave up (worker.guard.give_up): no batch helps, the settings must
    change. One line, exit 3, and the supervisor told why (`cause`), so that it ends the job
    at once instead of relaunching the same divergence."""

    exit_code = WORKER_DIVERGED
    cause = "diverged"

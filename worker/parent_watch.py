"""A rank must not train on alone once its launcher is gone (`ES_EXIT_WITH_PARENT=1`).

Two guards: the kernel's parent-death signal, asked for as soon as the beacon is made (Linux
only), and a look at the parent pid at every beat (`ParentWatch`, on the beacon's thread), which
holds wherever the signal is not to be had.
"""

from __future__ import annotations

import ctypes
import os
import signal

from contracts import env_names


def wanted() -> bool:
    """Whether the supervisor asked its ranks to die with their launcher."""
    return os.environ.get(env_names.ENV_EXIT_WITH_PARENT) == "1"


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


class ParentWatch:
    """The parent this process started under; `check` ends the process once it changed."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.parent = os.getppid()

    def check(self) -> None:
        if self.enabled and os.getppid() != self.parent:
            # Our launcher died without taking us along: do not train on alone.
            os.kill(os.getpid(), signal.SIGKILL)

"""This process as a child subreaper: what it takes, and what the watch does without it.

Marked a subreaper (Linux's PR_SET_CHILD_SUBREAPER), the supervisor gets back every process of
its tree that a dying parent orphans (ranks whose launcher died, a rank's helper), so the
teardown finds them as its own children; without it they go to init, and only a read of the
tree made while their parent lived remembers them.
"""

from __future__ import annotations

import ctypes

PR_SET_CHILD_SUBREAPER = 36
PR_GET_CHILD_SUBREAPER = 37
# How often an attempt's process tree is re-read for its teardown (tree_refresh_s).
REFRESH_TREE_S = 10.0
REFRESH_TREE_NO_REAPER_S = 2.0


def become_subreaper() -> bool:
    """Orphaned descendants (ranks whose launcher died) become our children, so we find them."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def is_subreaper() -> bool:
    """Whether this process is a child subreaper (become_subreaper took)."""
    flag = ctypes.c_int(0)
    return _prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag)) and bool(flag.value)


def _prctl(option: int, arg) -> bool:
    """Linux's prctl(option, arg); False where it fails or there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def tree_refresh_s() -> float:
    """How often to re-read an attempt's process tree, for its teardown: seldom where this
    process is a subreaper (the teardown reads the tree again, and what a dying parent orphans
    comes back to us; each read walks the host's process table once per root, which at every
    2 s was most of the supervisor's CPU beside the ranks), else every 2 s: an orphan then goes
    to init, and only a read made while its parent lived remembers it."""
    return REFRESH_TREE_S if is_subreaper() else REFRESH_TREE_NO_REAPER_S

"""The warm standby's rules: when it is ready, whether the next attempt uses it, waits for it or
starts cold without it, and how long to wait before starting another after one was lost (a
broken environment must not loop).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from supervisor.policy.liveness import RankState
from supervisor.policy.restarts import backoff_delay


def standby_unavailable(*, wanted: bool, declared: bool, module: str) -> str | None:
    """Why this job keeps no warm standby, or None when it does. A standby's ranks are the
    worker started with `ES_STANDBY=1`; only a worker whose spec declares it
    (`STANDBY_MODULES`) waits for `go`: any other would train beside the job, a second one
    writing the same checkpoints."""
    if not wanted:
        return "restart.standby is false"
    if not declared:
        return (
            f"worker.module {module!r} does not declare standby support (STANDBY_MODULES in "
            "its package's spec)"
        )
    return None


def standby_ready(ranks: Mapping[int, RankState], world: int) -> bool:
    """Every rank of the standby has said it is prepared and waiting."""
    return len(ranks) == world and all(st.phase == "standby" for st in ranks.values())


def standby_unusable(
    ready: bool, alive: bool, standby_nodes: Sequence[str], bad_nodes: Sequence[str]
) -> str | None:
    """Why the next attempt cannot be the standby (it then starts cold), or None to use it.
    `standby_nodes`: where the standby was launched, alive or not."""
    bad = ", ".join(sorted(set(standby_nodes) & set(bad_nodes)))
    if not alive and bad:  # a node loss: its ranks there died, and the whole standby with them
        return (
            f"the standby ended with the failed node {bad}: its ranks formed one job and one "
            "process group with that node's, which a spare cannot join"
        )
    if not alive:
        return "no standby running"
    if not ready:
        return "the standby was not ready"
    if bad:
        return f"the standby runs on the failed node {bad}"
    return None


# Wait for a standby still starting only when its start is at least this far along (seconds):
# a cold launch would redo all of it, so waiting must save more than the estimate can be off.
WAIT_SAVES_AT_LEAST_S = 1.0
WAIT_SLACK = 0.25  # a wait is bounded by the estimate plus this share of it (at least 0.5 s)


@dataclass(frozen=True)
class StandbyChoice:
    """What the next attempt does with the standby: `use` it, `wait` up to `wait_s` for it to
    be ready (then use it, or drop it if it is still not), or `drop` it and start cold (`why`,
    the relaunch's `cold_because`)."""

    action: Literal["use", "wait", "drop"]
    why: str | None = None
    wait_s: float = 0.0


def standby_choice(
    ready: bool,
    alive: bool,
    standby_nodes: Sequence[str],
    bad_nodes: Sequence[str],
    starting_s: float = 0.0,
    prepare_s: float | None = None,
) -> StandbyChoice:
    """Use, wait for or drop the standby at a failure. `starting_s`: how long the standby has
    been starting; `prepare_s`: how long a standby of this job took from launch to ready (None
    when none has been ready yet). A cold launch redoes the standby's whole preparation, so one
    well along is worth waiting for; anything else is dropped (ended without holding up the
    cold launch)."""
    why = standby_unusable(ready, alive, standby_nodes, bad_nodes)
    if why is None:
        return StandbyChoice("use")
    on_bad = standby_unusable(True, alive, standby_nodes, bad_nodes)
    if on_bad is not None or prepare_s is None:  # gone, on a bad node, or no estimate
        return StandbyChoice("drop", on_bad or why)
    left = max(0.0, prepare_s - starting_s)
    if starting_s >= WAIT_SAVES_AT_LEAST_S and left < starting_s:
        return StandbyChoice("wait", why, round(left + max(0.5, WAIT_SLACK * left), 3))
    return StandbyChoice("drop", why)


# A relaunch with at most this many steps to redo starts the next standby once past them.
CATCH_UP_STEPS = 3


def standby_start_step(first_step: int, newest_before: int | None) -> int:
    """Pure: the step of an attempt at whose end the next standby is started. Its first step,
    or, when it resumed a few steps behind the newest step done before the failure
    (`newest_before`), the first step past that one: a standby's start (imports, model build)
    takes the cores beside the ranks, and would slow the very steps that recover the
    failure's loss. Far behind (more than CATCH_UP_STEPS to redo), its first step: the
    recompute is long, and a failure during it would find no standby."""
    if newest_before is None or newest_before - first_step + 1 > CATCH_UP_STEPS:
        return first_step
    return max(first_step, newest_before + 1)


STANDBY_GIVE_UP_AFTER = 5  # standbys lost in a row before ever being ready: stop keeping one


def standby_retry_delay(lost_in_a_row: int, schedule: Sequence[float]) -> float | None:
    """Seconds before starting another standby after `lost_in_a_row` (>= 1) were lost without
    getting ready, or None to stop keeping one (a broken environment must not loop). The
    restart schedule's delays, at least 1 s: a standby is never urgent."""
    if lost_in_a_row >= STANDBY_GIVE_UP_AFTER:
        return None
    return max(1.0, backoff_delay(lost_in_a_row - 1, schedule))

"""The warm standby's rules: when it is ready, why the next attempt cannot use it, and how long
to wait before starting another after one was lost (a broken environment must not loop).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from supervisor.policy.liveness import RankState
from supervisor.policy.restarts import backoff_delay


def standby_ready(ranks: Mapping[int, RankState], world: int) -> bool:
    """Every rank of the standby has said it is prepared and waiting."""
    return len(ranks) == world and all(st.phase == "standby" for st in ranks.values())


def standby_unusable(
    ready: bool, alive: bool, standby_nodes: Sequence[str], bad_nodes: Sequence[str]
) -> str | None:
    """Why the next attempt cannot be the standby (it then starts cold), or None to use it."""
    if not alive:
        return "no standby running"
    if not ready:
        return "the standby was not ready"
    bad = sorted(set(standby_nodes) & set(bad_nodes))
    if bad:
        return f"the standby runs on the failed node {', '.join(bad)}"
    return None


STANDBY_GIVE_UP_AFTER = 5  # standbys lost in a row before ever being ready: stop keeping one


def standby_retry_delay(lost_in_a_row: int, schedule: Sequence[float]) -> float | None:
    """Seconds before starting another standby after `lost_in_a_row` (>= 1) were lost without
    getting ready, or None to stop keeping one (a broken environment must not loop). The
    restart schedule's delays, at least 1 s: a standby is never urgent."""
    if lost_in_a_row >= STANDBY_GIVE_UP_AFTER:
        return None
    return max(1.0, backoff_delay(lost_in_a_row - 1, schedule))

"""Checkpoint intervals that tune themselves (`"auto"`): the names and the formula both sides use.

The supervisor decides an "auto" tier's interval from the costs the ranks measure and the
failures it sees (`supervisor/policy/intervals.py`) and tells the ranks (control action
`interval`, and `ES_MEM_CKPT_INTERVAL` / `ES_SAVE_INTERVAL` at a launch); a rank that has not been
told, or runs without a supervisor, tunes itself from the same formula with the prior MTBF alone
(`worker/intervals.py`). One formula, here, so the two never disagree on what "optimal" means.
"""

from __future__ import annotations

import math

AUTO = "auto"
MEMORY, DURABLE = "memory", "durable"
TIERS = (MEMORY, DURABLE)
# The worker flag of each tier (its `[worker]` key), and the env name a launch sets it by.
FLAG_OF = {MEMORY: "mem_ckpt_interval", DURABLE: "save_interval"}
MAX_STEPS = 10**9  # no interval is longer, whatever the formula says
HYSTERESIS = 0.2  # an interval moves only when the optimum is a fifth or more away from it...
MIN_BAND_STEPS = 0.75  # ...and at least this many steps


def daly_seconds(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum: the seconds of work between two checkpoints that each cost
    `cost_s`, under failures `mtbf_s` apart on average (Young's sqrt(2CM), corrected; at
    C >= 2M, M itself). J. T. Daly, "A higher order estimate of the optimum checkpoint interval
    for restart dumps", FGCS 22 (2006)."""
    if mtbf_s <= 0:
        return 0.0
    if cost_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


def exact_steps(cost_s: float, step_s: float, mtbf_s: float, max_steps: int) -> float:
    """Daly's optimum in steps of `step_s`, not rounded, within [1, max_steps]."""
    top = max(1, min(max_steps, MAX_STEPS))
    if not (step_s > 0 and math.isfinite(step_s) and math.isfinite(cost_s) and cost_s >= 0):
        return 1.0  # nothing sound to go by: the shortest interval
    seconds = daly_seconds(cost_s, mtbf_s) if math.isfinite(mtbf_s) else math.inf
    return min(float(top), max(1.0, seconds / step_s))


def interval_steps(cost_s: float, step_s: float, mtbf_s: float, max_steps: int) -> int:
    """Daly's optimum in whole steps of `step_s`, within [1, max_steps]."""
    return round(exact_steps(cost_s, step_s, mtbf_s, max_steps))


def retune(
    old: int | None, cost_s: float, step_s: float, mtbf_s: float, max_steps: int, by: float
) -> int | None:
    """The interval for these measures when its exact optimum moved a fraction `by` of `old`,
    the interval in force, and at least `MIN_BAND_STEPS`, away from it (None: none yet, any
    value is new); else None. A dead band around the interval in force: measures that wander
    about a rounding point (1.4, 1.6, 1.4 steps) do not flip it back and forth."""
    exact = exact_steps(cost_s, step_s, mtbf_s, max_steps)
    if old is None:
        return round(exact)
    if abs(exact - old) < max(by * old, MIN_BAND_STEPS) or round(exact) == old:
        return None
    return round(exact)

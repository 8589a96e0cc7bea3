"""Checkpoint intervals that tune themselves (`[worker] mem_ckpt_interval` or `save_interval` =
"auto"): Young/Daly from what one copy or save costs the steps and how often this job fails.

Pure: `supervisor/run/intervals.py` collects the facts (rank 0's costs and step times, the
failures the job has seen) and acts on the decision (the event, the control message to the
ranks). The failure rate follows a change: it is taken over the job's last `WINDOW` failures,
and the time since the last one counts (a quiet spell raises the estimate before the next
failure comes); until the first failure, the prior MTBF stands for one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from contracts import intervals

WINDOW = 5  # the failures the rate is taken over (about +-45 % noise: 1/sqrt(5))
# Pseudo-failures at the prior MTBF before the first real one. 1: gone at the first failure (2
# kept it as one of two after it: a job failing every 2 s under a 60 s prior kept an interval of
# 130 steps for its second failure, which threw 80 steps away; in the 10x-change simulation of
# the tests, 1 wasted as little or less, and less with a prior 10x off).
PRIOR_WEIGHT = 1
HYSTERESIS = intervals.HYSTERESIS  # the dead band around the interval in force, as the ranks'


@dataclass(frozen=True)
class IntervalInputs:
    """What one tier's decision is made from (seconds; times since the job's first step)."""

    cost_s: float  # what one copy or save costs the steps (the stall, the hand-over, CPU beside)
    step_s: float  # a step's seconds (rank 0's recent median)
    failures_s: Sequence[float]  # when each failure of this job was seen, oldest first
    elapsed_s: float  # now
    prior_mtbf_s: float  # the MTBF assumed until failures are seen
    max_steps: int  # no interval longer than this (the run's last step)


@dataclass(frozen=True)
class IntervalDecision:
    """The interval for the inputs, and whether it is worth telling the ranks."""

    steps: int
    mtbf_s: float  # the failure estimate it came from
    send: bool  # it differs enough from the interval in force (or none was sent yet)


def mtbf_estimate(failures_s: Sequence[float], elapsed_s: float, prior_mtbf_s: float) -> float:
    """Seconds between failures, as this job has seen them lately: the time since the failure
    before the last `WINDOW` (or since the job's first step) over their count, with the prior's
    pseudo-failures added until real ones replace them. A gamma-Poisson mean over a sliding
    window: it drops at once when failures come closer together and rises through a quiet
    spell."""
    n = len(failures_s)
    counted = min(n, WINDOW)
    since = failures_s[n - WINDOW - 1] if n > WINDOW else 0.0
    exposure = max(0.0, elapsed_s - since)
    prior = max(0, PRIOR_WEIGHT - n)
    if prior + counted == 0:
        return math.inf
    return (prior * prior_mtbf_s + exposure) / (prior + counted)


def decide(inputs: IntervalInputs, current: int | None) -> IntervalDecision:
    """Young/Daly for the inputs, in steps; `send` when its exact optimum moved `HYSTERESIS`
    or more from `current` (the interval last sent; None: none yet), else `current` again."""
    mtbf = mtbf_estimate(inputs.failures_s, inputs.elapsed_s, inputs.prior_mtbf_s)
    moved = intervals.retune(
        current, inputs.cost_s, inputs.step_s, mtbf, inputs.max_steps, HYSTERESIS
    )
    if moved is None and current is not None:
        return IntervalDecision(current, mtbf, False)
    return IntervalDecision(moved or 1, mtbf, True)

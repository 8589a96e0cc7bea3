"""What one copy or save costs the steps, and how long a step takes, as rank 0 says them: the
measures an "auto" checkpoint interval is decided from (supervisor.policy.intervals).

Rank 0's `step` messages carry its step's seconds (`dt`) and, after a copy or a save, what it
cost the loop (`cost`, by tier: the stall and the hand-over, and on CPU the memory tier's
threads' CPU beside the steps). Medians of the recent ones, so that
one slow step or save does not move the interval; an attempt's first step (its start-up) is not
a step time.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from contracts.intervals import TIERS

RECENT_COSTS = 20
RECENT_STEPS = 200  # steps slowed for a while by a busy host move the interval, not each one
MIN_STEPS = 3  # step times before there is a step time to go by


class CostMeter:
    """Recent costs by tier and step times, from rank 0's step messages of running attempts."""

    def __init__(self) -> None:
        self.costs: dict[str, deque[float]] = {t: deque(maxlen=RECENT_COSTS) for t in TIERS}
        self.steps: deque[float] = deque(maxlen=RECENT_STEPS)
        self._attempt: int | None = None  # the attempt whose step messages come in

    def on_step(self, msg: dict[str, Any]) -> list[str]:
        """Rank 0's `step` message (a message of another rank or kind is no measure): the
        tiers it brought a new cost of."""
        if msg["kind"] != "step" or msg["rank"] != 0:
            return []
        if msg["attempt"] == self._attempt:
            self.steps.append(float(msg["dt"]))
        self._attempt = msg["attempt"]  # its first step message: start-up, not a step time
        new = []
        for tier, seconds in msg.get("cost", {}).items():
            self.costs[tier].append(float(seconds))
            new.append(tier)
        return new

    def cost_s(self, tier: str) -> float | None:
        """One copy's or save's recent median cost; None before the first."""
        return statistics.median(self.costs[tier]) if self.costs[tier] else None

    def step_s(self) -> float | None:
        """A step's recent median seconds; None before `MIN_STEPS` of them."""
        return statistics.median(self.steps) if len(self.steps) >= MIN_STEPS else None

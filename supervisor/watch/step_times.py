"""Each rank's latest step compute, as its beats and steps (or its node's relay summaries) say
it, gathered into observations for the straggler score (supervisor.policy.stragglers).

An observation is every rank's latest compute, once every rank has said a step past the
previous observation's: each one then holds a fresh value of every rank, about one a heartbeat
interval (ranks other than 0 say their steps at most that often).
"""

from __future__ import annotations

from typing import Any

from contracts import messages


class StepTimes:
    """The ranks' latest (step, compute) of one attempt of `world` ranks."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.latest: dict[int, tuple[int, float]] = {}
        self.observed_step = -1  # the step of the last observation

    def take(self, msg: dict[str, Any]) -> None:
        """A verified message of this attempt; those without compute seconds change nothing."""
        kind = msg["kind"]
        if kind == "beat" or kind == "step":
            compute = msg.get("compute")
            if compute is not None and 0 <= msg["rank"] < self.world:
                self.latest[msg["rank"]] = (msg["step"], compute)
        elif kind == "summary" and "compute" in msg:
            ranks = messages.expand_ranks(msg["ranks"])
            steps = messages.expand(msg["steps"])
            for rank, step, compute in zip(ranks, steps, msg["compute"], strict=True):
                if compute is not None and 0 <= rank < self.world:
                    self.latest[rank] = (step, compute)

    def observation(self) -> tuple[int, dict[int, float]] | None:
        """(step, rank -> compute) when every rank said a step past the last observation's;
        else None."""
        if len(self.latest) < self.world:
            return None
        if min(step for step, _ in self.latest.values()) <= self.observed_step:
            return None
        self.observed_step = max(step for step, _ in self.latest.values())
        return self.observed_step, {rank: c for rank, (_, c) in self.latest.items()}

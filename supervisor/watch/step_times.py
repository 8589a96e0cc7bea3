"""Each rank's step computes, as its beats and steps (or its node's relay summaries) say them,
gathered into observations for the straggler score (supervisor.policy.stragglers).

An observation is one compute of every rank. Where every rank's beats and steps carry the steps
since its previous message (`recent`: the default, without relays), each step every rank has
said is one observation: the score's window counts steps. Where they do not (a relay's summary
says only each rank's latest compute), an observation is every rank's latest compute, once every
rank has said a step past the previous observation's: about one a heartbeat interval.
"""

from __future__ import annotations

from typing import Any

from contracts import messages

# Per rank, the steps said and not yet observed that are kept (older ones cannot be matched).
KEEP_STEPS = 4 * messages.MAX_RECENT


class StepTimes:
    """The ranks' recent (step -> compute) and latest (step, compute) of one attempt."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.latest: dict[int, tuple[int, float]] = {}
        self.steps: dict[int, dict[int, float]] = {}  # rank -> step -> compute, not observed
        self.observed_step = -1  # the step of the last observation
        self.newest = -1  # the newest step any rank has said

    def take(self, msg: dict[str, Any]) -> None:
        """A verified message of this attempt; those without compute seconds change nothing."""
        kind = msg["kind"]
        if kind == "beat" or kind == "step":
            rank, compute = msg["rank"], msg.get("compute")
            if not 0 <= rank < self.world:
                return
            for step, seconds in msg.get("recent", ()):
                self._step(rank, step, seconds)
            if compute is not None:
                self.latest[rank] = (msg["step"], compute)
            self.newest = max(self.newest, msg["step"])
        elif kind == "summary" and "compute" in msg:
            ranks = messages.expand_ranks(msg["ranks"])
            steps = messages.expand(msg["steps"])
            for rank, step, compute in zip(ranks, steps, msg["compute"], strict=True):
                if compute is not None and 0 <= rank < self.world:
                    self.latest[rank] = (step, compute)
                    self.newest = max(self.newest, step)

    def _step(self, rank: int, step: int, compute: float) -> None:
        self.latest[rank] = (step, compute)
        if step <= self.observed_step:
            return  # observed already (or a step trained again after a roll-back)
        said = self.steps.setdefault(rank, {})
        said[step] = compute
        if len(said) > KEEP_STEPS:  # a rank far ahead of another: its oldest cannot be matched
            del said[next(iter(said))]

    def observations(self) -> list[tuple[int, dict[int, float]]]:
        """(step, rank -> compute) for each step past the last observation's that every rank
        said; else, without such steps, every rank's latest once each said a newer step."""
        if len(self.latest) < self.world:
            return []
        upto = min(step for step, _ in self.latest.values())
        if len(self.steps) == self.world and upto > self.observed_step:
            said = list(self.steps.values())
            out = [
                (step, {rank: s[step] for rank, s in self.steps.items()})
                for step in range(max(self.observed_step + 1, upto - KEEP_STEPS), upto + 1)
                if all(step in s for s in said)
            ]
            if out:
                for s in said:
                    for step in range(self.observed_step + 1, out[-1][0] + 1):
                        s.pop(step, None)
                self.observed_step = out[-1][0]
                return out
        if upto <= self.observed_step:
            return []
        self.observed_step = max(step for step, _ in self.latest.values())
        return [(self.observed_step, {rank: c for rank, (_, c) in self.latest.items()})]

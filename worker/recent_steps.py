"""Each step's compute seconds since the rank's previous message (the `recent` field), so that
the supervisor's straggler score sees every step of every rank, not one a heartbeat interval.

The training thread adds a step; the beat thread takes what is there with its next message.
Both sides use only a deque's append and popleft, which are thread-safe; a rolled-back step
(the numerical guard) starts the list again, so the steps sent are always ascending.
"""

from __future__ import annotations

from collections import deque

from contracts.messages import MAX_RECENT


class RecentSteps:
    """The newest MAX_RECENT (step, compute) pairs not sent yet."""

    def __init__(self) -> None:
        self._pairs: deque[tuple[int, float]] = deque(maxlen=MAX_RECENT)

    def add(self, step: int, compute: float) -> None:
        if self._pairs and self._pairs[-1][0] >= step:
            self._pairs.clear()  # rolled back: the steps before are trained again
        self._pairs.append((step, compute))

    def take(self) -> list[list[float]]:
        """What was added since the last take, as the message's pairs (ascending steps)."""
        out: list[list[float]] = []
        while True:
            try:
                step, compute = self._pairs.popleft()
            except IndexError:
                return out
            if out and out[-1][0] >= step:  # a roll-back raced with this take
                out.clear()
            out.append([step, compute])

"""The training loop's per-step hook for what the supervisor tells a rank to do inside a step
(the control channel's commands other than a signal and a standby's: worker.control_channel).

No torch here.
"""

from __future__ import annotations

import time

from worker.beat import Beacon


class StepFaults:
    """The training loop's per-step hook for the supervisor's in-step commands: `stall` blocks
    inside the step for good (the beat thread keeps beating: progress is lost, liveness is not);
    `slow` sleeps `delay_s` at every step until `duration_s` has passed (a straggler); `nan` and
    `spike` are handed to the numerical guard (`numeric`), `interval` to the checkpoint
    intervals (`intervals`)."""

    def __init__(self, beacon: Beacon) -> None:
        self._beacon = beacon
        self._delay_s = 0.0
        self._slow_until = 0.0
        self._numeric: list[tuple[int, str, float]] = []
        self._intervals: list[tuple[str, int, int]] = []

    def intervals(self) -> list[tuple[str, int, int]]:
        """`interval` commands since the last call, as (tier, every, from step)."""
        out, self._intervals = self._intervals, []
        return out

    def numeric(self) -> list[tuple[int, str, float]]:
        """`nan` and `spike` commands since the last call, as (step, kind, factor) for the
        numerical guard (worker.guard_step), which applies each at the first step it runs at or
        after the command's step: one that comes early is held, one that comes late applies at
        the next step."""
        out, self._numeric = self._numeric, []
        return out

    def apply(self) -> None:
        for cmd in self._beacon.commands():
            if cmd["action"] == "stall":
                while True:
                    time.sleep(1)
            if cmd["action"] == "slow":
                self._delay_s = cmd["delay_s"]
                self._slow_until = time.monotonic() + cmd["duration_s"]
            if cmd["action"] in ("nan", "spike"):
                self._numeric.append((cmd["step"], cmd["action"], cmd["factor"]))
            if cmd["action"] == "interval":
                self._intervals.append((cmd["tier"], cmd["interval"], cmd["step"]))
        if self._delay_s and time.monotonic() < self._slow_until:
            time.sleep(self._delay_s)

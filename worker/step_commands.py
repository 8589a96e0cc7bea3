"""The training loop's per-step hook for what the supervisor tells a rank to do inside a step
(the control channel's commands other than a signal and a standby's: worker.control_channel).

No torch here.
"""

from __future__ import annotations

import time

from worker.beat import Beacon
from worker.guard import Injected


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
        self._numeric: list[Injected] = []
        self._intervals: list[tuple[str, int, int]] = []

    def intervals(self) -> list[tuple[str, int, int]]:
        """`interval` commands since the last call, as (tier, every, from step)."""
        out, self._intervals = self._intervals, []
        return out

    def numeric(self) -> list[Injected]:
        """`nan` and `spike` commands since the last call, for the numerical guard
        (worker.guard_step), which applies each at the command's step: one that comes early is
        held for it, one that comes after that step began is not applied (the rank says so)."""
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
                self._numeric.append(
                    Injected(cmd["step"], cmd["action"], cmd["factor"], cmd["fault"])
                )
            if cmd["action"] == "interval":
                self._intervals.append((cmd["tier"], cmd["interval"], cmd["step"]))
        if self._delay_s and time.monotonic() < self._slow_until:
            time.sleep(self._delay_s)

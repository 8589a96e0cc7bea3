"""The learner of an attempt's "auto" limits: the samples its ranks' messages show, and the
limits in force. The rules that derive a limit from samples, and whether a new value replaces
the one in force, are pure (supervisor.policy.limits); this keeps the samples between messages.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field

from supervisor.policy.limits import (
    WARMUP_STEPS,
    WINDOW,
    Limits,
    auto_save_limit,
    auto_timeout,
    auto_train_limit,
    fixed_limits,
    limit_changed,
)
from supervisor.settings.config import AUTO, HeartbeatConfig
from supervisor.watch.table_events import EventToEmit

DERIVE_EVERY_S = 0.5  # how often the "auto" limits are derived again from their samples
SAVES_KEPT = 20


@dataclass
class Learner:
    """An attempt's "auto" limits: the samples they are learned from (what its ranks' messages
    show: rank 0's step gaps and save times, every rank's beat gaps, all while training) and
    the limits in force (`limits.auto_*` derive, `limits.limit_changed` adopts). Each
    attempt learns anew: a relaunch starts at the maximum, and its first steps (slow) are not
    samples."""

    heartbeat: HeartbeatConfig
    limits: Limits
    step_gaps: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    beat_gaps: deque = field(default_factory=lambda: deque(maxlen=WINDOW))
    saves: deque = field(default_factory=lambda: deque(maxlen=SAVES_KEPT))
    warmup_left: int = WARMUP_STEPS
    # rank (or ("relay", node): a relay's summaries are its node's beats) -> last beat, phase
    last_beat: dict[int | tuple[str, str], tuple[float, str]] = field(default_factory=dict)
    save_started: float | None = None
    next_derive: float = 0.0
    relayed: bool = False  # beats came as relays' summaries (the timeout's slack)

    @classmethod
    def wanted(cls, heartbeat: HeartbeatConfig | None) -> Learner | None:
        if heartbeat is None:
            return None
        auto = AUTO in (heartbeat.timeout_s, heartbeat.progress.train, heartbeat.progress.save)
        return cls(heartbeat, fixed_limits(heartbeat)) if auto else None

    def beat(self, rank: int | tuple[str, str], phase: str, now: float) -> None:
        if rank.__class__ is tuple:
            self.relayed = True
        last = self.last_beat.get(rank)
        self.last_beat[rank] = (now, phase)
        if last is not None and last[1] == "train" and phase == "train":
            self.beat_gaps.append(now - last[0])

    def moved(self, before: tuple[str, int, float], phase: str, now: float) -> None:
        """Rank 0's step or phase moved from `before` (phase, step, when it last moved)."""
        old, _, since = before
        if old == "train" and phase == "train":
            if self.warmup_left > 0:
                self.warmup_left -= 1
            else:
                self.step_gaps.append(now - since)
        if phase == "save" and old != "save":
            self.save_started = now
        elif old == "save" and phase != "save" and self.save_started is not None:
            self.saves.append(now - self.save_started)
            self.save_started = None

    def derive(self, now: float) -> list[EventToEmit]:
        """Every DERIVE_EVERY_S: the limits from their samples now; an event for each adopted."""
        if now < self.next_derive:
            return []
        self.next_derive = now + DERIVE_EVERY_S
        heartbeat, cap, events = self.heartbeat, self.heartbeat.auto_max, []
        if heartbeat.progress.train == AUTO:
            got = auto_train_limit(self.step_gaps, self.beat_gaps, heartbeat.interval_s, cap.train)
            events += self._adopt("train", got)
        if heartbeat.progress.save == AUTO:
            events += self._adopt("save", auto_save_limit(self.saves, cap.save))
        if heartbeat.timeout_s == AUTO:
            got = auto_timeout(self.beat_gaps, heartbeat.interval_s, cap.timeout_s, self.relayed)
            events += self._adopt("timeout_s", got)
        return events

    def _adopt(self, name: str, got: tuple[float, dict] | None) -> list[EventToEmit]:
        if got is None:
            return []
        value, basis = got
        lim = self.limits
        if name == "timeout_s":
            current = lim.train_timeout_s or lim.timeout_s
        else:
            current = lim.progress[name]
        if name in lim.learned and not limit_changed(current, value):
            return []
        if name == "timeout_s":
            lim = dataclasses.replace(lim, train_timeout_s=value)
        else:
            lim = dataclasses.replace(lim, progress={**lim.progress, name: value})
        self.limits = dataclasses.replace(lim, learned=lim.learned | {name})
        said = {"limit": name, "seconds": round(value, 3), "previous_s": round(current, 3)}
        return [EventToEmit("auto_limit", {**said, **basis})]

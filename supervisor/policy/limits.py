"""The limits a rank is judged by: the config's, or ("auto") learned from the run's own step
times, beat gaps and saves. The derivations are pure: supervisor.watch.auto_limits collects the
samples and adopts what comes out, so the rules are tested with plain numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from supervisor.settings.config import AUTO, HeartbeatConfig


@dataclass(frozen=True)
class Limits:
    """The liveness timeout and the progress limits in force (seconds). `train_timeout_s`: the
    liveness timeout while a rank trains, once learned (other phases keep `timeout_s`: a save
    or a load may hold a rank's GIL long enough to delay its beats). `learned`: which limits
    are learned values now: `timeout_s`, `train`, `save`."""

    timeout_s: float
    progress: Mapping[str, float]
    train_timeout_s: float | None = None
    learned: frozenset[str] = frozenset()


def fixed_limits(heartbeat: HeartbeatConfig) -> Limits:
    """The config's limits, each "auto" at its maximum: what holds until something is learned."""
    cap = heartbeat.auto_max
    timeout = cap.timeout_s if heartbeat.timeout_s == AUTO else heartbeat.timeout_s
    progress = {}
    for phase in ("init", "load", "train", "save"):
        v = getattr(heartbeat.progress, phase)
        progress[phase] = getattr(cap, phase, 0.0) if v == AUTO else v
    return Limits(float(timeout), progress)


@dataclass(frozen=True)
class AutoRule:
    """How one "auto" limit is derived: `multiple` x the recent p99 of its samples (+ slack),
    never below `floor_s` nor above the maximum; nothing before `min_samples` samples."""

    multiple: float
    floor_s: float
    min_samples: int


# Conservative on purpose: a false finding costs a relaunch. Step gaps on a loaded 2-core host
# reach 3-5x their median; p99 over the recent window already holds the spikes seen so far.
TRAIN_RULE = AutoRule(multiple=4.0, floor_s=1.5, min_samples=20)  # and >= 2 beat intervals
# Beats come from a thread on a timer, not from the steps: their gaps are tight (a p99 of
# 1.01-1.15 s at a 1 s interval in 97 learned timeouts of this host's soak and test runs, 3 or 4
# ranks on 2 busy cores), and every second of the timeout is a second more of each hang.
TIMEOUT_RULE = AutoRule(multiple=3.0, floor_s=2.0, min_samples=20)  # and >= 3 beat intervals
SAVE_RULE = AutoRule(multiple=4.0, floor_s=10.0, min_samples=2)
WARMUP_STEPS = 5  # an attempt's first step gaps are not samples (start-up: allocation, caches)
WINDOW = 200  # the recent samples a p99 is taken over


def quantile(samples: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (0 < q <= 1) of a non-empty sample."""
    ordered = sorted(samples)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def auto_train_limit(
    step_gaps: Sequence[float], beat_gaps: Sequence[float], interval_s: float, max_s: float
) -> tuple[float, dict] | None:
    """Pure: the train progress limit learned from rank 0's recent step gaps (one step's end to
    the next, in phase train): `multiple` x their p99, plus the p99 gap between beats (the
    other ranks' step reaches us only with a beat, up to a beat late), within [floor, max_s];
    the floor is at least two beat intervals. None until there are enough samples."""
    rule = TRAIN_RULE
    if len(step_gaps) < rule.min_samples:
        return None
    p99_step = quantile(step_gaps, 0.99)
    p99_beat = quantile(beat_gaps, 0.99) if beat_gaps else interval_s
    floor = max(rule.floor_s, 2 * interval_s)
    value = min(max_s, max(floor, rule.multiple * p99_step + p99_beat))
    basis = {"p99_step_s": round(p99_step, 4), "p99_beat_gap_s": round(p99_beat, 4),
             "samples": len(step_gaps), "multiple": rule.multiple, "floor_s": floor,
             "max_s": max_s}  # fmt: skip
    return value, basis


def auto_timeout(
    beat_gaps: Sequence[float], interval_s: float, max_s: float, relayed: bool = False
) -> tuple[float, dict] | None:
    """Pure: the liveness timeout while training, learned from the gaps between consecutive
    beats of each rank: `multiple` x their p99, within [floor, max_s]; the floor is at least
    three beat intervals. Under relays the gaps are a node's summaries', and a rank's own beat
    in a summary may be up to one interval older than it: one interval more. None until there
    are enough samples."""
    rule = TIMEOUT_RULE
    if len(beat_gaps) < rule.min_samples:
        return None
    p99 = quantile(beat_gaps, 0.99)
    floor = max(rule.floor_s, 3 * interval_s)
    slack = interval_s if relayed else 0.0
    value = min(max_s, max(floor, rule.multiple * p99 + slack))
    basis = {"p99_beat_gap_s": round(p99, 4), "samples": len(beat_gaps),
             "multiple": rule.multiple, "relay_slack_s": slack, "floor_s": floor,
             "max_s": max_s}  # fmt: skip
    return value, basis


def auto_save_limit(durations: Sequence[float], max_s: float) -> tuple[float, dict] | None:
    """Pure: the save progress limit learned from how long rank 0's recent saves took:
    `multiple` x the longest, within [floor, max_s]. None until enough saves were seen."""
    rule = SAVE_RULE
    if len(durations) < rule.min_samples:
        return None
    longest = max(durations)
    value = min(max_s, max(rule.floor_s, rule.multiple * longest))
    basis = {"longest_save_s": round(longest, 4), "samples": len(durations),
             "multiple": rule.multiple, "floor_s": rule.floor_s, "max_s": max_s}  # fmt: skip
    return value, basis


def limit_changed(current: float, derived: float) -> bool:
    """Whether a derived limit differs enough from the one in force to replace it (and be said
    in an event): up by 10 % (and 0.1 s), or down by 25 % (and 0.2 s). Rising follows load
    at once; falling waits for a clear change, so the limit does not flap step by step."""
    if derived > current:
        return derived - current >= max(0.1, 0.10 * current)
    return current - derived >= max(0.2, 0.25 * current)

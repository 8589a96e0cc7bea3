"""The checkpoint intervals a run goes by: a number of steps, or "auto" (tuned while it runs).

Every rank must copy and save at the same steps, or the copies and saves are not collective
(a rank waits in a save that the others skip). So an "auto" tier's interval is never read from
what one rank was told: rank 0 puts the interval it holds into each step's agreement (the one
small all-reduce of the loop, `worker.loop.agree`), the others put 0, and every rank adopts
the sum: rank 0's word, at the same step on every rank.

What rank 0 holds, in order of authority:

- the supervisor's word: `ES_MEM_CKPT_INTERVAL` / `ES_SAVE_INTERVAL` at the launch, then each
  control `interval` command, applied at the first step at or after the step it names (a late
  one: at the next step; the agreement keeps the ranks together either way);
- until the supervisor speaks (a first attempt, a run without a supervisor): its own Young/Daly
  interval from the costs it measures, its step times and the prior MTBF (`--mtbf-prior-s`);
- before any cost is measured: one copy or save at the run's first step, to measure it (the
  memory tier: at its first four steps, the fourth the measure, `COLD_COPIES`).

No torch here: the loop hands the values in and out as numbers.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from contracts import intervals
from contracts.env_names import INTERVAL_ENV
from worker.errors import UsageError

RECENT = 20  # the costs and step times a rank's own tuning takes the median of
MIN_STEP_SAMPLES = 3  # step times before a rank tunes itself (the first step of a run is not one)
# A tier's first copies in a process whose cost is not a sample. The memory tier's first does
# its one-time set-up in the hand-over (the state view, the check that the state fits, the
# partner link), and each of its two slots (`slot_file.SLOTS`) is filled for the first time by
# the first copy into it. Measured on the debug preset: the first stalled 0.16 s at a job's
# first step and 0.026-0.053 s after a take-over, those after it 0.001-0.003 s; taken as C,
# the first set the interval at 28 steps until the first failure, not 3-4. One more: on CPU a
# copy's cost counts the tier's threads' CPU since the copy before (its seal and partner send,
# and a partner's first fills of its slots). So "auto" copies at the first four steps and
# measures from the fourth. A durable save's first is a sample: another save to measure would
# cost a whole save.
COLD_COPIES = {intervals.MEMORY: 3, intervals.DURABLE: 0}


@dataclass
class Tier:
    """One tier's interval: `every` steps (0: off; None: "auto" before its first measure)."""

    auto: bool
    every: int | None  # in force: as every rank agreed
    proposed: int | None = None  # rank 0's: what it puts into the next agreement
    steered: bool = False  # the supervisor's word counts now; no tuning of its own
    pending: list[tuple[int, int]] = field(default_factory=list)  # (from step, every), told
    costs: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    last: int = 0  # "auto": the step of the last copy or save (or the step resumed from)
    cold: int = 0  # copies still to come whose cost is not a sample (COLD_COPIES)


class Intervals:
    """The memory tier's and the durable tier's intervals, as every rank agrees on them."""

    def __init__(
        self,
        flags: Mapping[str, int | str],
        *,
        rank: int,
        memory_on: bool,
        prior_mtbf_s: float,
        max_steps: int,
        env: Mapping[str, str],
    ) -> None:
        self.rank, self.prior_mtbf_s, self.max_steps = rank, prior_mtbf_s, max_steps
        self.tiers: dict[str, Tier] = {}
        for tier in intervals.TIERS:
            value = flags[tier]
            if tier == intervals.MEMORY and not memory_on:
                value = 0  # "auto" without --ckpt-dir: no memory tier
            cold = COLD_COPIES[tier]
            if value != intervals.AUTO:
                self.tiers[tier] = Tier(auto=False, every=int(value), cold=cold)
                continue
            told = started_by(env, tier)
            self.tiers[tier] = Tier(True, told, told, steered=told is not None, cold=cold)
        self.steps: deque[float] = deque(maxlen=RECENT)
        self.first_step = 1
        self.changed: dict[str, int] = {}  # agreed changes not yet put on a metrics record

    def begin(self, first_step: int) -> None:
        """The run's (or the resumed run's) first step: an "auto" tier counts from the step
        before it (the state it resumed, a checkpoint's)."""
        self.first_step = first_step
        for tier in self.tiers.values():
            tier.last = first_step - 1

    # --- when a copy or a save is due -------------------------------------------------------
    def due(self, tier: str, step: int) -> bool:
        """Whether `tier` copies or saves at the end of `step`, asked once a step (the same on
        every rank). A number: at its multiples. "auto": `every` steps after the last copy or
        save, so that a change never leaves a gap longer than the new interval (at multiples,
        a change from 27 to 41 at step 498 left 486 to 533)."""
        t = self.tiers[tier]
        if not t.auto:
            return bool(t.every) and step % t.every == 0
        if step <= t.last:  # rolled back (the numerical guard) to before it
            t.last = step - 1
        if t.every is None:  # nothing measured yet: at the run's first step (and the cold ones)
            due = self.first_step <= step <= self.first_step + COLD_COPIES[tier]
        else:
            due = step - t.last >= t.every
        if due:
            t.last = step
        return due

    def every(self, tier: str) -> int | None:
        return self.tiers[tier].every

    # --- the agreement ------------------------------------------------------------------------
    def offer(self, step: int) -> list[float]:
        """This rank's part of `step`'s agreement: rank 0's interval of each "auto" tier (0: not
        tuned yet), 0 from every other rank."""
        if self.rank != 0:
            return [0.0] * len(intervals.TIERS)
        out = []
        for name in intervals.TIERS:
            tier = self.tiers[name]
            due = [p for p in tier.pending if p[0] <= step]
            if due:
                tier.pending = [p for p in tier.pending if p[0] > step]
                tier.proposed, tier.steered = due[-1][1], True
            out.append(float(tier.proposed or 0) if tier.auto else 0.0)
        return out

    def agreed(self, values: list[float]) -> None:
        """Rank 0's word, the same on every rank: each "auto" tier's interval from here on (0:
        rank 0 has none yet, nothing changes)."""
        for name, value in zip(intervals.TIERS, values, strict=True):
            tier, every = self.tiers[name], int(value)
            if tier.auto and every >= 1 and every != tier.every:
                tier.every = every
                self.changed[name] = every

    def take_changed(self) -> dict[str, int]:
        """The intervals changed since the last call (for the metrics record)."""
        out, self.changed = self.changed, {}
        return out

    # --- what rank 0 goes by ------------------------------------------------------------------
    def told(self, tier: str, every: int, from_step: int) -> None:
        """The supervisor's `interval` command (rank 0 keeps it; the agreement carries it)."""
        if tier in self.tiers and self.tiers[tier].auto and every >= 1:
            self.tiers[tier].pending.append((from_step, every))

    def after_step(self, step: int, dt: float, costs: Mapping[str, float]) -> dict[str, float]:
        """A step's seconds (a run's first step, slow with its start-up, is left out) and what
        the copies and saves since the last step cost it. Rank 0, not told by the supervisor
        yet, tunes each "auto" tier itself from them (offered at the next step's agreement).
        Returns the costs that are samples (a tier's cold copies left out): the supervisor's."""
        samples = {}
        for name, seconds in costs.items():
            tier = self.tiers.get(name)
            if tier is not None and tier.cold > 0:
                tier.cold -= 1
            else:
                samples[name] = seconds
        if self.rank != 0:
            return samples
        if step > self.first_step:
            self.steps.append(dt)
        for name, seconds in samples.items():
            if name in self.tiers:
                self.tiers[name].costs.append(seconds)
        if len(self.steps) < MIN_STEP_SAMPLES:
            return samples
        for tier in self.tiers.values():
            if tier.auto and not tier.steered and tier.costs:
                every = intervals.retune(
                    tier.proposed,
                    statistics.median(tier.costs),
                    statistics.median(self.steps),
                    self.prior_mtbf_s,
                    self.max_steps,
                    intervals.HYSTERESIS,
                )
                tier.proposed = every or tier.proposed
        return samples


def started_by(env: Mapping[str, str], tier: str) -> int | None:
    """The interval the supervisor launched this rank with, or None."""
    name = INTERVAL_ENV[tier]
    text = env.get(name)
    if not text:
        return None
    try:
        every = int(text)
    except ValueError:
        every = 0
    if every < 1:
        raise UsageError(f"{name}={text!r}: expected a number of steps >= 1")
    return every

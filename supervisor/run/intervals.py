"""The job's "auto" checkpoint intervals (`[worker] mem_ckpt_interval` or `save_interval` =
"auto"): decided again on every failure and as rank 0's costs come in (policy.intervals), said
in an `interval_changed` event, and told to the ranks.

Told how: the running attempt's rank 0 by the control action `interval`, from a step a little
ahead of its newest (rank 0 puts it into the step's agreement, so every rank switches at the
same step: worker.intervals); the ranks launched after it (a standby waiting, prepared ranks
becoming, a cold relaunch) by `ES_MEM_CKPT_INTERVAL` / `ES_SAVE_INTERVAL` at their launch, and
a standby by the command too when a failure changes the interval after its launch. What each
attempt has been told is kept, and a command that did not reach it is sent again with its next
step message. Until the first decision the ranks tune themselves from the prior.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contracts import control_msgs, intervals
from contracts.env_names import INTERVAL_ENV
from supervisor.policy import intervals as policy
from supervisor.policy.restarts import AttemptRecord
from supervisor.settings import worker_flags
from supervisor.settings.config import Config
from supervisor.watch.ckpt_costs import CostMeter
from supervisor.watch.control import ControlServer

LEAD_S = 0.25  # a new interval starts this far ahead of rank 0's newest step...
MIN_LEAD_STEPS = 2  # ...and at least this many steps ahead


@dataclass(frozen=True)
class AutoTiers:
    """Which tiers are "auto", and what their decisions assume."""

    tiers: tuple[str, ...]
    prior_mtbf_s: float
    max_steps: int


def auto_tiers(cfg: Config) -> AutoTiers | None:
    """The job's "auto" tiers from its worker flags (the worker's defaults for those left out),
    or None when it has none. The memory tier needs a checkpoint dir (resolved: always)."""
    flags = worker_flags.with_defaults(cfg)
    tiers = tuple(t for t in intervals.TIERS if flags.get(intervals.FLAG_OF[t]) == intervals.AUTO)
    if intervals.MEMORY in tiers and not flags.get("ckpt_dir"):
        tiers = tuple(t for t in tiers if t != intervals.MEMORY)
    if not tiers:
        return None
    prior, last = flags.get("mtbf_prior_s", 3600.0), flags.get("train_iters")
    max_steps = last if isinstance(last, int) and last > 0 else intervals.MAX_STEPS
    return AutoTiers(tiers, float(prior), max_steps)


class IntervalKeeper:
    """The intervals in force, the failures seen, the costs measured; one per job."""

    def __init__(
        self,
        auto: AutoTiers,
        job_id: str,
        control: ControlServer,
        emit: Callable[..., None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.auto, self.job_id, self.control, self.emit = auto, job_id, control, emit
        self.clock = clock
        self.started: float | None = None  # the job's first step: failures are counted from it
        self.meter = CostMeter()
        self.failures: list[float] = []  # when each was seen, seconds since the first step
        self.current: dict[str, int] = {}  # the interval decided last, by tier
        self.told: dict[int, dict[str, int]] = {}  # attempt -> what its rank 0 was told
        self.standbys: set[int] = set()  # attempts launched as a standby
        self.running: int | None = None  # the attempt rank 0's steps come from
        self.ended = False  # it failed: nothing more to tell it
        self.newest = 0  # its newest step

    # --- what happens ---------------------------------------------------------------------------
    def rank_env(self, attempt: int, standby: bool) -> dict[str, str]:
        """The intervals an attempt's ranks start with (none before the first decision)."""
        self.told[attempt] = dict(self.current)
        if standby:
            self.standbys.add(attempt)
        return {INTERVAL_ENV[tier]: str(every) for tier, every in self.current.items()}

    def on_message(self, msg: dict[str, Any]) -> None:
        """A verified rank message: rank 0's steps of the newest attempt bring step times and
        costs (each cost: a decision for its tier), and a chance to resend what did not
        arrive."""
        if msg["kind"] != "step" or msg["rank"] != 0:
            return
        attempt = msg["attempt"]
        if self.running is not None and attempt < self.running:
            return  # a straggler of an attempt that is over
        first = attempt != self.running
        self.running, self.newest, self.ended = attempt, msg["step"], False
        if self.started is None:
            self.started = self.clock()
        costs = self.meter.on_step(msg)
        for tier in self.auto.tiers:  # a new cost; or the first step time after one
            if tier in costs or (tier not in self.current and self.meter.cost_s(tier) is not None):
                self._decide(tier, "cost")
        self._resend(attempt, 0 if first else self._from_step())

    def attempt_ended(self, record: AttemptRecord) -> None:
        """An attempt that trained and failed is a failure to count: every tier is decided
        again, and a standby already launched told at once (from its first step). One that
        never stepped lost no work an interval could have saved."""
        if record.outcome != "failure" or record.max_step is None or self.started is None:
            return
        self.failures.append(self.clock() - self.started)
        self.ended = True
        for tier in self.auto.tiers:
            self._decide(tier, "failure")

    # --- deciding and telling ---------------------------------------------------------------------
    def _decide(self, tier: str, why: str) -> None:
        cost, step = self.meter.cost_s(tier), self.meter.step_s()
        if cost is None or step is None or self.started is None:
            return  # nothing measured yet: the ranks tune themselves from the prior
        inputs = policy.IntervalInputs(
            cost, step, self.failures, self.clock() - self.started, self.auto.prior_mtbf_s,
            self.auto.max_steps,
        )  # fmt: skip
        decision = policy.decide(inputs, self.current.get(tier))
        if not decision.send:
            return
        old, self.current[tier] = self.current.get(tier), decision.steps
        live = self.running is not None and not self.ended
        targets = {self.running: self._from_step()} if live else {}
        targets |= {s: 0 for s in self.standbys if self.running is None or s > self.running}
        reached = [
            (a, f) for a, f in sorted(targets.items()) if self._tell(a, tier, decision.steps, f)
        ]
        self.emit(
            "interval_changed",
            tier=tier,
            old=old,
            new=decision.steps,
            why=why,
            cost_s=round(cost, 6),
            step_s=round(step, 6),
            mtbf_s=round(decision.mtbf_s, 3) if math.isfinite(decision.mtbf_s) else None,
            prior_mtbf_s=self.auto.prior_mtbf_s,
            failures=len(self.failures),
            elapsed_s=round(inputs.elapsed_s, 3),
            to={str(attempt): from_step for attempt, from_step in reached},
        )

    def _from_step(self) -> int:
        """A step a little ahead of rank 0's newest, so that it has the word before then."""
        step_s = self.meter.step_s() or 1.0
        return self.newest + max(MIN_LEAD_STEPS, math.ceil(LEAD_S / step_s))

    def _resend(self, attempt: int, from_step: int) -> None:
        told = self.told.setdefault(attempt, {})
        for tier, every in self.current.items():
            if told.get(tier) != every:
                self._tell(attempt, tier, every, from_step)

    def _tell(self, attempt: int, tier: str, every: int, from_step: int) -> bool:
        """The `interval` command to the attempt's rank 0; remembered once sent."""
        message = control_msgs.control_message(
            self.job_id, attempt, 0, time.time(), "interval", 0, step=from_step, tier=tier,
            interval=every,
        )  # fmt: skip
        if self.control.send(attempt, 0, message) is not None:
            return False  # not connected (yet): sent again with its next step message
        self.told.setdefault(attempt, {})[tier] = every
        return True

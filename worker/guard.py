"""The numerical guard's decisions, pure (no torch): is a step bad and of which kind, the running
baseline a spike is judged against, which data positions a bad step skips, and which data
position a step trains on once some are skipped.

A step's loss and gradient norm are judged before its update: a non-finite value on any rank
is a fault at once; a spike is the mean loss (or the global gradient norm) above its running
baseline by a factor, judged only after `warmup` good steps. Every input is a value all ranks
hold alike, so every rank decides the same. The acting side is worker.guard_step.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

ACTIONS = ("off", "skip", "rollback")
KINDS = ("nan", "inf", "spike")

Range = tuple[int, int]  # data positions first..last, both included
_RANGE = re.compile(r"[0-9]{1,18}(-[0-9]{1,18})?")  # up to 10^18: far past any run
MAX_SKIP_BATCHES = 10**9  # a rollback's skip: the positions it leads to stay under 10^18
MAX_RECORD_CHARS = 1_000_000  # a data record's `skip`: ~50,000 ranges, far past any run


@dataclass(frozen=True)
class GuardConfig:
    """What `--guard*` asks for."""

    action: str = "off"
    factor: float = 4.0  # the mean loss above baseline x this is a spike
    grad_factor: float = 10.0  # the global gradient norm above baseline x this is a spike
    warmup: int = 20  # good steps before spikes are judged; also the baseline's window
    skip_batches: int = 1  # rollback: skip at least this many data positions

    @property
    def on(self) -> bool:
        return self.action != "off"


@dataclass(frozen=True)
class Baseline:
    """Running means of the good steps' mean loss and gradient norm: a plain mean over the
    first `window` good steps, then an exponential one with weight 1/window. Part of the
    checkpoint's data record, so a resumed run judges as the uninterrupted one."""

    good: int = 0
    loss: float = 0.0
    grad: float = 0.0

    def updated(
        self, loss: float, grad: float, window: int, limits: tuple[float, float] | None = None
    ) -> Baseline:
        """`limits` (the spike factors): once there is a baseline, a value enters it at most
        at its spike limit. Only a warm-up step can be above it (later, such a step is bad):
        whole, one 100x loss spike at step 4 of a 20-step warm-up hid 5x spikes until good
        step 79; clipped, they are caught from the warm-up's end."""
        if limits is not None and self.good:
            loss, grad = min(loss, limits[0] * self.loss), min(grad, limits[1] * self.grad)
        weight = 1.0 / min(self.good + 1, max(1, window))
        return Baseline(
            self.good + 1,
            self.loss + (loss - self.loss) * weight,
            self.grad + (grad - self.grad) * weight,
        )

    def record(self) -> dict[str, Any]:
        return {"good": self.good, "loss": self.loss, "grad": self.grad}

    @classmethod
    def from_record(cls, record: Any) -> Baseline:
        """A checkpoint's record (checked by `record_problem` when it was loaded); none (an
        older checkpoint) or anything malformed starts afresh, never a baseline that would
        divide by zero or judge against NaN."""
        if baseline_problem(record) is not None:
            return cls()
        return cls(record["good"], float(record["loss"]), float(record["grad"]))


@dataclass(frozen=True)
class Verdict:
    """A bad step: `kind` nan | inf | spike, and the value judged bad."""

    kind: str
    value: float
    what: str  # "loss" or "grad_norm"


def judge(
    cfg: GuardConfig, base: Baseline, mean_loss: float, grad_norm: float, nonfinite_ranks: int
) -> Verdict | None:
    """None for a good step. `nonfinite_ranks`: how many ranks saw a non-finite loss or local
    gradient (the agreement's sum), so a fault on one rank is every rank's."""
    if nonfinite_ranks or not (math.isfinite(mean_loss) and math.isfinite(grad_norm)):
        what, value = (
            ("loss", mean_loss) if not math.isfinite(mean_loss) else ("grad_norm", grad_norm)
        )
        return Verdict("nan" if math.isnan(value) else "inf", value, what)
    if base.good < cfg.warmup:
        return None
    if mean_loss > cfg.factor * base.loss:
        return Verdict("spike", mean_loss, "loss")
    if grad_norm > cfg.grad_factor * base.grad:
        return Verdict("spike", grad_norm, "grad_norm")
    return None


def blame(
    verdict: Verdict, cfg: GuardConfig, base: Baseline, losses: list[float], grads: list[float]
) -> tuple[Verdict, list[int]]:
    """The ranks behind a bad step, from every rank's own loss and local gradient norm (the one
    extra collective of a bad step): the ranks with a non-finite value (the verdict then names
    the first one's value), or for a loss spike those whose own loss is above the limit; every
    rank when none stands out."""
    every = list(range(len(losses)))
    if verdict.kind != "spike":
        bad = [r for r in every if not (math.isfinite(losses[r]) and math.isfinite(grads[r]))]
        if not bad:
            return verdict, every
        first = bad[0]
        what, value = (
            ("loss", losses[first])
            if not math.isfinite(losses[first])
            else ("grad_norm", grads[first])
        )
        return Verdict("nan" if math.isnan(value) else "inf", value, what), bad
    if verdict.what == "loss":
        high = [r for r in every if losses[r] > cfg.factor * base.loss]
        return verdict, high or every
    return verdict, every


@dataclass(frozen=True)
class Injected:
    """A bad step to make on this rank at step `step`: `nan` (one gradient poisoned) or `spike`
    (the loss scaled by `factor`). `fault`: the supervisor's fault index, whose `fault_ack` it
    waits for (None: an `ES_INJECT` point of a test)."""

    step: int
    kind: str
    factor: float = 1.0
    fault: int | None = None


@dataclass(frozen=True)
class Due:
    """What this rank's injected faults make of one step: the factor its loss is scaled by,
    whether a gradient is poisoned; those applied, and those that came past their step."""

    factor: float = 1.0
    poison: bool = False
    applied: tuple[Injected, ...] = ()
    late: tuple[Injected, ...] = ()


def injected_due(pending: list[Injected], step: int) -> tuple[Due, list[Injected]]:
    """The injected faults that act at `step`, and those left waiting: each acts once, at its
    very step (a step redone after a bad one is not hit again). One for a later step waits; one
    whose step began without it (it came late) is dropped, never moved to a later step, where
    the faults of neighbouring steps would land in one."""
    now = tuple(p for p in pending if p.step == step)
    late = tuple(p for p in pending if p.step < step)
    factor = math.prod(p.factor for p in now if p.kind == "spike")
    poison = any(p.kind == "nan" for p in now)
    return Due(float(factor), poison, now, late), [p for p in pending if p.step > step]


GIVE_UP_AFTER = 10  # bad steps in a row: the cause is no batch (diverged weights, a bad --lr)


def give_up(bad_in_a_row: int, step: int, verdict: Verdict) -> str | None:
    """Why the guard stops the run (None: it goes on). Skipping or rolling back only helps a
    bad batch: when no step passes for `GIVE_UP_AFTER` tries, every batch would be skipped
    for ever (weights that are already non-finite, a learning rate that blows them up, a loss
    that moved for good), so a person is told instead of the loop spinning."""
    if bad_in_a_row < GIVE_UP_AFTER:
        return None
    return (
        f"the numerical guard gave up: {bad_in_a_row} bad steps in a row at step {step} (the "
        f"last: {verdict.kind} in {verdict.what}); no batch helps, so the cause is likely the "
        "weights or the settings: lower --lr, resume from an earlier checkpoint, or raise "
        "--guard-factor / --guard-grad-factor if the loss moved for good"
    )


# --- data positions ------------------------------------------------------------------------------
def merge(ranges: list[Range] | tuple[Range, ...]) -> tuple[Range, ...]:
    """Sorted, with overlapping and adjacent ranges joined."""
    out: list[Range] = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return tuple(out)


def position(step: int, ranges: tuple[Range, ...]) -> int:
    """The data position step `step` trains on: the step-th position not in a skipped range
    (`ranges` merged; positions and steps count from 1)."""
    pos = step
    for first, last in ranges:
        if first <= pos:
            pos += last - first + 1
    return pos


def skip_range(bad_step: int, ranges: tuple[Range, ...]) -> Range:
    """`skip`: just the bad step's own data position."""
    pos = position(bad_step, ranges)
    return pos, pos


def rollback_range(
    ckpt_step: int, bad_step: int, ranges: tuple[Range, ...], skip_batches: int
) -> Range:
    """`rollback` to the checkpoint of `ckpt_step`: every position after the one it trained
    last, through the bad step's, and at least `skip_batches` of them."""
    first = position(ckpt_step, ranges) + 1
    last = max(position(bad_step, ranges), first + skip_batches - 1)
    return first, last


def parse_ranges(text: str) -> tuple[Range, ...]:
    """`A-B,C-D` (or a single position `A`) to merged ranges; ValueError saying what is wrong."""
    out: list[Range] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        if not _RANGE.fullmatch(part):  # ASCII digits only: str.isdigit takes "²", int() not
            raise ValueError(f"expected ranges of data positions like 5-9,20-20, got {part!r}")
        first, _, last = part.partition("-")
        a, b = int(first), int(last or first)
        if a < 1 or b < a:
            raise ValueError(f"{part!r}: positions start at 1 and a range's last is >= its first")
        out.append((a, b))
    return merge(out)


def format_ranges(ranges: tuple[Range, ...]) -> str:
    return ",".join(f"{a}-{b}" for a, b in ranges)


# --- a checkpoint's data record --------------------------------------------------------------
def baseline_problem(record: Any) -> str | None:
    """What is wrong with a record of `Baseline.record` (None: nothing)."""
    if not isinstance(record, dict) or set(record) != {"good", "loss", "grad"}:
        return "guard: expected a record {good, loss, grad}"
    good = record["good"]
    if type(good) is not int or good < 0:
        return f"guard.good: expected a count >= 0, got {good!r}"
    for key in ("loss", "grad"):
        value = record[key]
        if type(value) not in (int, float) or not (math.isfinite(value) and value >= 0):
            return f"guard.{key}: expected a finite number >= 0, got {value!r}"
    return None


def record_problem(data: Any) -> str | None:
    """What is wrong with the guard's part of a checkpoint's data record (None: nothing, or an
    older checkpoint without it): a resume takes it as it is, so a damaged one is refused
    rather than silently training other data positions or judging against a broken baseline."""
    if data is None:
        return None
    if not isinstance(data, dict):
        return f"the data record is a {type(data).__name__}, not a table"
    skip = data.get("skip", "")
    if not isinstance(skip, str) or len(skip) > MAX_RECORD_CHARS:
        return "skip: expected ranges of data positions like 5-9,20-20"
    try:
        parse_ranges(skip)
    except ValueError as exc:
        return f"skip: {exc}"
    if "guard" in data:
        return baseline_problem(data["guard"])
    return None


def past_problem(
    flag_ranges: tuple[Range, ...], resumed: tuple[Range, ...], step: int
) -> str | None:
    """`--skip-batches` on a resume may only skip positions the checkpoint of `step` has not
    trained yet: a range among those would make its record claim a skip that never happened
    and move every later step's data (None: the flags are fine)."""
    done = position(step, resumed)
    if position(step, merge([*resumed, *flag_ranges])) == done:
        return None
    return (
        f"the checkpoint resumed (step {step}) has trained data positions up to {done}; skip "
        f"only positions after {done} (or pass --no-resume to start over with these ranges)"
    )

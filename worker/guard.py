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
from dataclasses import dataclass
from typing import Any

ACTIONS = ("off", "skip", "rollback")
KINDS = ("nan", "inf", "spike")

Range = tuple[int, int]  # data positions first..last, both included


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

    def updated(self, loss: float, grad: float, window: int) -> Baseline:
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
        """A checkpoint's record; anything else (an older checkpoint) starts afresh."""
        if not isinstance(record, dict):
            return cls()
        try:
            return cls(int(record["good"]), float(record["loss"]), float(record["grad"]))
        except (KeyError, TypeError, ValueError):
            return cls()


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
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"expected ranges of data positions like 5-9,20-20, got {part!r}")
        a, b = int(first), int(last) if dash else int(first)
        if a < 1 or b < a:
            raise ValueError(f"{part!r}: positions start at 1 and a range's last is >= its first")
        out.append((a, b))
    return merge(out)


def format_ranges(ranges: tuple[Range, ...]) -> str:
    return ",".join(f"{a}-{b}" for a, b in ranges)

"""The numerical guard in the training loop: what it does with worker.guard's decisions.

After backward and clipping and before the update, each rank says in the step's one agreement
(the all-reduce that already carries the loss and the stop) whether its own loss or gradients
are non-finite; with the mean loss and the global gradient norm, which every rank holds alike,
every rank then judges the step the same (`GuardRun.judge`). A bad step drops its gradients and
makes no optimizer or scheduler step, so nothing of it reaches the weights; one more small
all-reduce names the ranks behind it. Then `skip` redoes the step with the next data position,
`rollback` reloads the newest checkpoint in the process (memory tier or durable) and skips the
positions since it. Rank 0 says each as one message (`numeric_fault`, `rollback`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from worker import guard
from worker.beat import Beacon
from worker.errors import UsageError
from worker.guard import Baseline, Due, GuardConfig, Injected, Range, Verdict
from worker.parallel import local_part


@dataclass
class GuardRun:
    """The guard's state in a run: its settings, the skipped data positions, the baseline, and
    the numeric faults injected into this rank that have not fired yet."""

    cfg: GuardConfig
    ranges: tuple[Range, ...] = ()
    baseline: Baseline = field(default_factory=Baseline)
    pending: list[Injected] = field(default_factory=list)
    bad_in_a_row: int = 0  # bad steps since the last good one (guard.give_up)

    @classmethod
    def start(
        cls,
        cfg: GuardConfig,
        flag_ranges: str,
        data: dict[str, Any] | None,
        faults: list[tuple[int, str, float]],
        step: int = 0,
    ) -> GuardRun:
        """From the flags and the data record of the checkpoint resumed at `step` (None: a
        fresh start): its skipped ranges and baseline come back with it. `--skip-batches` may
        add ranges only past the positions that checkpoint has trained (UsageError)."""
        run = cls(cfg, pending=[Injected(*f) for f in faults])
        run.restore(data)
        flags = guard.parse_ranges(flag_ranges)
        problem = guard.past_problem(flags, run.ranges, step) if data is not None else None
        if problem is not None:
            raise UsageError(f"--skip-batches {flag_ranges}: {problem}")
        run.ranges = guard.merge([*run.ranges, *flags])
        return run

    def restore(self, data: dict[str, Any] | None) -> None:
        """The checkpoint loads refuse a damaged record (worker.ckpt); one that reaches here
        anyway is a clear refusal, never a silent change of the data positions."""
        problem = guard.record_problem(data)
        if problem is not None:
            raise UsageError(f"the checkpoint's data record is damaged: {problem}")
        data = data or {}
        self.ranges = guard.merge([*self.ranges, *guard.parse_ranges(data.get("skip", ""))])
        self.baseline = Baseline.from_record(data.get("guard"))

    def record(self) -> dict[str, Any]:
        """What a checkpoint's data record holds of the guard."""
        return {"skip": guard.format_ranges(self.ranges), "guard": self.baseline.record()}

    def position(self, step: int) -> int:
        return guard.position(step, self.ranges)

    def skip(self, positions: Range) -> None:
        self.ranges = guard.merge([*self.ranges, positions])

    def due(self, step: int) -> Due:
        """This rank's injected faults for `step` (guard.injected_due); those left wait."""
        due, self.pending = guard.injected_due(self.pending, step)
        return due

    def judge(self, mean_loss: float, grad_norm: float, nonfinite: int) -> Verdict | None:
        """Every rank alike; a good step moves the baseline."""
        if not self.cfg.on:
            return None
        verdict = guard.judge(self.cfg, self.baseline, mean_loss, grad_norm, nonfinite)
        if verdict is None:
            limits = (self.cfg.factor, self.cfg.grad_factor)
            self.baseline = self.baseline.updated(mean_loss, grad_norm, self.cfg.warmup, limits)
            self.bad_in_a_row = 0
        else:
            self.bad_in_a_row += 1
        return verdict


def say_injected(beacon: Beacon, due: Due, step: int) -> None:
    """Tell the supervisor what came of its `nan` and `spike` commands at this step: applied
    (the loss is scaled, the gradient poisoned), or dropped as late (`at`: this step, past
    theirs). `ES_INJECT`'s own points are nobody's to tell."""
    for item, applied in [*((i, True) for i in due.applied), *((i, False) for i in due.late)]:
        if item.fault is not None:
            beacon.fault_ack(item.fault, item.step, item.kind, applied, step)


def poison(params: list[torch.nn.Parameter]) -> None:
    """The `nan` fault: one element of this rank's local gradient set to NaN."""
    for p in params:
        grad = local_part(p.grad)
        if grad is not None and grad.numel():
            grad.view(-1)[0] = math.nan
            return


def local_norm(params: list[torch.nn.Parameter]) -> float:
    """This rank's own gradients' norm (before clipping mixes every rank's in)."""
    grads = [local_part(p.grad) for p in params]
    grads = [g for g in grads if g is not None and g.numel()]
    if not grads:
        return 0.0
    return torch.nn.utils.get_total_norm(grads, 2.0).item()


def shared_values(
    loss: float,
    local_grad: float,
    stop_requested: bool,
    device: torch.device | None = None,
    more: Sequence[float] = (),
) -> torch.Tensor:
    """This rank's part of the step's agreement: its loss (0 when not finite, so the sum stays
    finite), whether it was asked to stop, whether its loss or gradients are non-finite; then
    `more` (what else the loop agrees on in the same all-reduce: worker.intervals)."""
    nonfinite = not (math.isfinite(loss) and math.isfinite(local_grad))
    own = 0.0 if nonfinite else loss
    values = [own, float(stop_requested), float(nonfinite), *more]
    return torch.tensor(values, dtype=torch.float64, device=device)  # nccl: on the device


def agreed(shared: torch.Tensor, world: int) -> tuple[float, bool, int]:
    """The all-reduced agreement: the mean loss (NaN on every rank when any rank's loss or
    gradients are not finite), whether to stop, how many ranks are non-finite."""
    count = int(shared[2].item())
    mean = math.nan if count else shared[0].item() / world
    return mean, shared[1].item() > 0, count


@dataclass(frozen=True)
class Stepped:
    """One step as the loop sees it once the ranks agreed."""

    loss: float  # this rank's
    local_grad: float  # this rank's own gradient norm (0 with the guard off)
    mean_loss: float
    stopping: bool
    verdict: Verdict | None  # None: a good step, applied


def every_rank(
    loss: float, local_grad: float, rank: int, world: int, device: torch.device | None = None
) -> tuple[list, list]:
    """A bad step only: every rank's own loss and gradient norm (one all-reduce of 2 x world)."""
    table = torch.zeros(2, world, dtype=torch.float64)
    table[0, rank], table[1, rank] = loss, local_grad
    table = table.to(device) if device is not None else table
    dist.all_reduce(table)
    return table[0].tolist(), table[1].tolist()

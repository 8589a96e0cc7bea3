"""Each step's seconds split into compute and wait in collectives, the straggler signal.

A rank that is slow makes the others wait for it in the next collective, so its own time in
collectives is short and its compute long, while theirs is the other way round: the supervisor
scores each rank's compute against the job's median (supervisor.policy.stragglers).

One clock per process (the collectives are called deep inside FSDP and clip): the loop starts
it at the top of a step and splits it at the end; every collective the step waits on adds its
seconds with `waiting()`. On CPU (gloo) a collective is waited for inside the timed region, so
the seconds are the real wait. On an accelerator FSDP's collectives run on their own streams and
are not timed here: only the host-side all-reduces (clip's norm, the stop agreement, each of
which syncs the host) add to the wait there (docs/worker.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


class StepClock:
    """A step's wall seconds and the part of them spent waiting in collectives."""

    def __init__(self) -> None:
        self._started = time.perf_counter()
        self.wait = 0.0

    def start(self) -> None:
        self._started, self.wait = time.perf_counter(), 0.0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.wait += time.perf_counter() - began

    def split(self) -> tuple[float, float]:
        """(compute, wait) seconds of the step so far; compute = wall - wait."""
        total = time.perf_counter() - self._started
        wait = min(self.wait, total)
        return total - wait, wait


CLOCK = StepClock()  # the process's one clock


def _timed(call: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a collective and wait for it on the clock; the work returned is already done."""
    with CLOCK.waiting():
        work = call(*args, async_op=True, **kwargs)
        if work is not None:
            work.wait()
    return work


class TimedAllGather:
    """FSDP2's all-gather (the interface of `FSDPModule.set_custom_all_gather`: `allocate` and
    the call), as its default does it, waited for on the clock."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):  # noqa: ANN001
        return _timed(dist.all_gather_single, output_tensor, input_tensor, group=group)


class TimedReduceScatter:
    """FSDP2's reduce-scatter, as its default does it, waited for on the clock."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001
        return _timed(dist.reduce_scatter_single, output_tensor, input_tensor, op=op, group=group)


def timed_collectives(module: Any) -> None:
    """FSDP2's all-gather and reduce-scatter of `module` on the clock (for CPU, gloo, only: an
    accelerator's collectives are left to FSDP's streams)."""
    module.set_custom_all_gather(TimedAllGather())
    module.set_custom_reduce_scatter(TimedReduceScatter())

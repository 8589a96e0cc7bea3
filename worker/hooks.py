"""Test hooks: where a rank fails on purpose when a test asks (the `--inject-*` flags).

The training loop and the checkpoint code call a `Hooks`; this base class does nothing, so a
run without those flags carries no test code on its path. `Hooks.from_args` builds the one that
acts. Faults the supervisor sends (faults/) take another road: `beat.StepFaults`.

No torch here.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from worker.args import TrainArgs

# Where in an async save a rank can be killed, in the order they happen.
AsyncPhase = Literal["stage", "write", "fanout", "marker", "after-marker"]


class Hooks:
    """The do-nothing hooks of a run without `--inject-*` flags."""

    write_delay_s: float = 0.0  # an async save's background write starts this late

    @staticmethod
    def from_args(args: TrainArgs, rank: int) -> Hooks:
        asked = (
            args.inject_raise_at_step,
            args.inject_stall_at_step,
            args.inject_kill_in_save_at_step,
            args.inject_kill_async_phase,
            args.inject_disk_full_at_step,
            args.inject_kill_in_mem_copy_at_step,
        )
        if all(a is None for a in asked) and not args.inject_ckpt_delay_s:
            return Hooks()
        return InjectedFaults(
            armed=rank == args.inject_rank,
            raise_at_step=args.inject_raise_at_step,
            stall_at_step=args.inject_stall_at_step,
            kill_in_save_at_step=args.inject_kill_in_save_at_step,
            kill_async_phase=args.inject_kill_async_phase,
            write_delay_s=args.inject_ckpt_delay_s,
            disk_full_at_step=args.inject_disk_full_at_step,
            kill_in_mem_copy_at_step=args.inject_kill_in_mem_copy_at_step,
        )

    def in_step(self, step: int) -> None:
        """At the start of every step."""

    def after_write(self, step: int) -> None:
        """A sync save: this rank's shards are written, the marker is not."""

    def in_async_phase(self, phase: AsyncPhase, step: int) -> None:
        """An async save of `step` has reached `phase` (on the thread that runs it)."""

    def before_shard(self, step: int, path: Path) -> None:
        """The save of `step` is about to write this rank's shard file `path`."""

    def in_memory_copy(self, step: int) -> None:
        """The memory copy of `step` has copied the bytes but not sealed its slot."""


@dataclass(frozen=True)
class InjectedFaults(Hooks):
    """Fail, stall or SIGKILL the armed rank (`--inject-rank`) at the steps the flags name;
    the write delay holds on every rank (a slow file system is everyone's)."""

    armed: bool
    raise_at_step: int | None = None
    stall_at_step: int | None = None
    kill_in_save_at_step: int | None = None
    kill_async_phase: str | None = None
    write_delay_s: float = 0.0
    disk_full_at_step: int | None = None
    kill_in_mem_copy_at_step: int | None = None

    def in_step(self, step: int) -> None:
        if not self.armed:
            return
        if step == self.raise_at_step:
            raise RuntimeError(f"injected failure at step {step}")
        if step == self.stall_at_step:
            while True:  # blocked inside the step; the beat thread keeps beating
                time.sleep(1)

    def after_write(self, step: int) -> None:
        if self.armed and step == self.kill_in_save_at_step:
            _die()

    def in_async_phase(self, phase: AsyncPhase, step: int) -> None:
        if self.armed and phase == self.kill_async_phase and step == self.kill_in_save_at_step:
            _die()

    def before_shard(self, step: int, path: Path) -> None:
        if self.armed and step == self.disk_full_at_step:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def in_memory_copy(self, step: int) -> None:
        if self.armed and step == self.kill_in_mem_copy_at_step:
            _die()


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)

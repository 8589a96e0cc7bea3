"""Test hooks: where a rank fails on purpose when a test arms a point in `ES_INJECT`
(contracts.inject).

The training loop and the checkpoint code call a `Hooks`; this base class does nothing, so a
run that arms nothing carries no test code on its path. `from_env` reads the variable once, at
start, and builds the one that acts. Faults the supervisor sends (faults/) take another road:
`step_commands.StepFaults`.

No torch here.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from contracts import inject
from contracts.env_names import ENV_INJECT
from contracts.inject import AsyncPhase
from worker import late_writes
from worker.ckpt.fail_points import NoFailPoints
from worker.errors import UsageError


class Hooks(NoFailPoints):
    """The do-nothing hooks of a run that arms no point."""

    def in_step(self, step: int) -> None:
        """At the start of every step."""

    def numeric_faults(self) -> list[tuple[int, str, float]]:
        """(step, "nan" | "spike", factor): what the numerical guard must catch on this rank."""
        return []


def from_env(
    env: Mapping[str, str], rank: int, async_ckpt: bool, ckpt_dir: str | None = None
) -> Hooks:
    """This rank's hooks from `ES_INJECT` in `env`; UsageError (exit 2) on a bad value."""
    try:
        points = inject.read(env)
    except inject.InjectError as exc:
        raise UsageError(str(exc)) from None
    if points.kill_async_phase and not async_ckpt:
        raise UsageError(f"{ENV_INJECT}: kill_async_phase needs --async-ckpt")
    if not points.arms_the_worker():
        return Hooks()
    return InjectedFaults(
        armed=rank == points.rank,
        raise_at_step=points.raise_at_step,
        stall_at_step=points.stall_at_step,
        kill_in_save_at_step=points.kill_in_save_at_step,
        kill_async_phase=points.kill_async_phase,
        write_delay_s=points.ckpt_delay_s,
        disk_full_at_step=points.disk_full_at_step,
        kill_in_mem_copy_at_step=points.kill_in_mem_copy_at_step,
        damage_partner_copies_at_step=points.damage_partner_copies_at_step,
        nan_at_step=points.nan_at_step,
        spike_at_step=points.spike_at_step,
        spike_factor=points.spike_factor,
        write_when_cut_s=points.write_when_cut_s,
        ckpt_dir=ckpt_dir,
    )


@dataclass(frozen=True)
class InjectedFaults(Hooks):
    """Fail, stall or SIGKILL the armed rank (the point `rank`) at the steps the points name;
    the write delay holds on every rank (a slow file system is everyone's)."""

    armed: bool
    raise_at_step: int | None = None
    stall_at_step: int | None = None
    kill_in_save_at_step: int | None = None
    kill_async_phase: AsyncPhase | None = None
    write_delay_s: float = 0.0
    disk_full_at_step: int | None = None
    kill_in_mem_copy_at_step: int | None = None
    damage_partner_copies_at_step: int | None = None
    nan_at_step: int | None = None
    spike_at_step: int | None = None
    spike_factor: float = 100.0
    write_when_cut_s: float | None = None
    ckpt_dir: str | None = None

    def numeric_faults(self) -> list[tuple[int, str, float]]:
        if not self.armed:
            return []
        faults = [(self.nan_at_step, "nan", 1.0), (self.spike_at_step, "spike", self.spike_factor)]
        return [(s, kind, factor) for s, kind, factor in faults if s is not None]

    def in_step(self, step: int) -> None:
        if not self.armed:
            return
        if self.write_when_cut_s is not None and self.ckpt_dir:
            late_writes.start(Path(self.ckpt_dir), self.write_when_cut_s)
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

    def partner_held(self, step: int, path: Path, offset: int) -> None:
        start = self.damage_partner_copies_at_step
        if self.armed and start is not None and step >= start:
            with path.open("r+b") as f:  # one byte flipped: damage, after the seal
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)

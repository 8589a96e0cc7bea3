"""The one thing the training loop calls about checkpoints: a `CheckpointManager`.

The loop calls `save` at a save step, `before_update` before each optimizer step, `poll` after
each step and `close` before it exits; whether saves are sync or async (`--async-ckpt`) is the
manager's mode, not the loop's concern. Each mode says what happened the same way: timings on
the next step's metrics record, checkpoint states on the beacon, a line on rank 0's output.
Without `--ckpt-dir` every call does nothing.

The resume side: `resume.choose` picks the checkpoint before the model is built, `load` reads it
once the model, optimizer and scheduler exist.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from contracts import ckpt_files
from contracts.env_names import ENV_JOB_ID, node_name
from contracts.intervals import DURABLE, MEMORY
from worker.ckpt import disk, memory, resume
from worker.ckpt.async_save import AsyncCheckpointer, PollReport, Readiness, default_stage_root
from worker.ckpt.checkpointer import Checkpointer, Resumed
from worker.ckpt.fail_points import SaveFailPoints
from worker.ckpt.memory import MemoryChoice, MemoryTier, SlotRefused
from worker.ckpt.memory.held import Held
from worker.ckpt.memory.partner_link import PartnerStats
from worker.ckpt.ports import DataCheck, Reporter, Timings
from worker.ckpt.resume import Chosen, RunIdentity
from worker.ckpt.settings import CkptSettings
from worker.dist import RankInfo


class CheckpointManager:
    """No checkpoints (no `--ckpt-dir`): nothing is saved, nothing resumed."""

    def load(self, chosen: Chosen) -> Resumed | None:
        """The state of `chosen` into the model, optimizer, scheduler and RNGs."""
        return None

    def start(self) -> None:
        """After the load: the set-up saving needs (the async mode's collective)."""

    def save(self, step: int, tokens_seen: int, data: dict[str, Any]) -> None:
        """Checkpoint the state as of the end of `step`."""

    def save_memory(self, step: int, tokens_seen: int, data: dict[str, Any]) -> None:
        """After a step the memory tier copies (the loop says which: worker.intervals)."""

    def take_costs(self) -> dict[str, float]:
        """What the copies and saves cost the loop since the last call, by tier (`memory`,
        `durable`: seconds it was blocked, and on CPU the memory tier's threads' CPU beside it),
        for the intervals' tuning."""
        return {}

    def before_update(self) -> None:
        """Before the optimizer step, which changes the state a save may still be copying."""

    def poll(self, step: int) -> None:
        """After every step: mark a save in flight as soon as every rank's copy is done."""

    def close(self, step: int) -> None:
        """Before exit: drain and mark a save in flight."""

    def rollback(self, bad_step: int) -> Resumed | None:
        """Collective, for the numerical guard: the newest checkpoint (memory tier or durable)
        of this run from before `bad_step` back into the live state; None when there is none
        to go back to."""
        return None


def create_manager(
    settings: CkptSettings,
    info: RankInfo,
    *,
    identity: RunIdentity,
    device_type: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    metrics: Timings,
    beacon: Reporter,
    say: Callable[..., None],
    hooks: SaveFailPoints,
    data_check: DataCheck,
) -> CheckpointManager:
    if not settings.ckpt_dir:
        return CheckpointManager()
    base = Checkpointer(
        Path(settings.ckpt_dir),
        rank=info.rank,
        world=info.world,
        device_type=device_type,
        identity=identity,
        keep=settings.keep,
        verify=settings.verify,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        hooks=hooks,
        data_check=data_check,
    )
    memory_tier = None
    expect = resume.memory_expect(settings, info.rank, identity, info.host)
    if expect is not None:
        memory_tier = MemoryTier(
            resume.memory_dir(settings),
            expect,
            interval=settings.mem_interval,
            local_world=info.local_world,
            model=model,
            optimizer=optimizer,
            describe=base.describe,
            hooks=hooks,
            partner=settings.mem_partner,
            node=node_name(os.environ, info.host),
        )
    if not settings.async_save:
        return SyncManager(base, metrics, beacon, say, memory_tier)
    stage_root = (
        Path(settings.stage_dir)
        if settings.stage_dir
        else default_stage_root(settings.ckpt_dir, os.environ.get(ENV_JOB_ID))
    )
    return AsyncManager(
        base,
        metrics,
        beacon,
        say,
        memory_tier,
        stage_root=stage_root,
        local_rank=info.local_rank,
        timeout_s=settings.timeout_s,
        hooks=hooks,
    )


def _data_problem(check: DataCheck, held: Held, meta: dict[str, Any]) -> str | None:
    """A slot whose data record (skipped ranges, guard baseline) is damaged is refused like
    a torn one: resumed as it is, it would train other data positions."""
    problem = check(meta.get("data"))
    return None if problem is None else f"slot {held.slot} (step {held.step}): data {problem}"


class SyncManager(CheckpointManager):
    """A save blocks the loop until every rank's shards are durable and the marker written.
    With the memory tier, its copies run beside the next step (the same in both modes)."""

    def __init__(
        self,
        base: Checkpointer,
        metrics: Timings,
        beacon: Reporter,
        say: Callable[..., None],
        memory_tier: MemoryTier | None = None,
    ):
        self.base = base
        self.metrics, self.beacon, self.say = metrics, beacon, say
        self.memory = memory_tier
        self.memory_handover = 0.0  # what the memory tier's save call blocked, after the step
        self.memory_said = -1  # the newest sealed memory copy said to the supervisor
        self.partner_seen: PartnerStats | None = None  # the partner counts said so far
        self.costs: Counter[str] = Counter()  # seconds by tier, since the last take_costs

    def take_costs(self) -> dict[str, float]:
        out, self.costs = dict(self.costs), Counter()
        return out

    def load(self, chosen: Chosen) -> Resumed | None:
        """Collective with the memory tier: a slot that a rank refuses at load (a chunk that
        fails its checksum, a layout that is not the live state's) is removed on that rank, and
        every rank chooses again (the other slot's step, the durable tier)."""
        why = chosen.why
        while isinstance(chosen.source, MemoryChoice):
            held = chosen.source.held
            problem = None
            try:
                meta = self.memory.load(held, self.base.scheduler)
            except SlotRefused as exc:
                problem = str(exc)
            except Exception as exc:  # a slot that passed its checks yet does not load (a
                # crafted record): refused alike, so that every rank reaches the agreement
                problem = f"slot {held.slot} (step {held.step}): {type(exc).__name__}: {exc}"
            else:
                problem = _data_problem(self.base.data_check, held, meta)
            refused = memory.first_refusal(problem)
            if refused is None:
                self.memory.resumed_from(held)
                self.base.own_steps.add(held.step)
                self.base.last_saved_step = -1  # nothing durable of this step yet
                source = "partner" if chosen.source.from_partner else "memory"
                resumed = Resumed(
                    meta["step"], meta["tokens_seen"], held.path, source, why, meta.get("data")
                )
                self.say(f"RESUMED from step={resumed.step} ({source}, {held.path})", flush=True)
                if why:
                    self.say(f"memory tier passed over: {why}", flush=True)
                return resumed
            if problem is not None:
                self.memory.forget_slot(held)  # no later agreement picks it again
            why = resume.told(why, refused)
            self.say(f"memory tier: refused at load: {refused}; choosing again", flush=True)
            chosen = resume.choose_tiers(
                self.base.root,
                rank=self.base.rank,
                verify=self.base.verify,
                memory_at=(self.memory.directory, self.memory.expect),
                say=self.say,
                why=why,
                partner=self.memory.partner_wanted,
            )
            why = chosen.why
            if chosen.source is None:  # the live state is partly a refused slot's by now
                raise RuntimeError(
                    f"memory slot refused at load ({why}) and no durable checkpoint to resume "
                    "instead: the relaunch starts fresh"
                )
        if chosen.source is None:
            return None
        resumed = self.base.load(chosen.source)
        resumed.why = why
        self.say(f"RESUMED from step={resumed.step} ({chosen.source})", flush=True)
        if why:
            self.say(f"memory tier passed over: {why}", flush=True)
        return resumed

    def rollback(self, bad_step: int) -> Resumed | None:
        """Saves in flight drained first (`drain`), so the newest complete one counts; then
        chosen and loaded as a relaunch would (a slot refused at load: the next choice). Only
        a checkpoint this process saved or resumed from, of a step before `bad_step`: with
        --no-resume the directory may hold another run's (seen: a rollback at step 2 loaded
        the previous run's step 6 and went on from there)."""
        self.drain()
        memory_at = None
        if self.memory is not None and memory.on_everywhere(self.memory):
            memory_at = (self.memory.directory, self.memory.expect)
        chosen = resume.choose_tiers(
            self.base.root,
            rank=self.base.rank,
            verify=self.base.verify,
            memory_at=memory_at,
            say=self.say,
            partner=self.memory.partner_wanted if memory_at else False,
        )
        if chosen.source is None:
            return None
        if not resume.may_roll_back_to(self._step_of(chosen), bad_step, self.base.own_steps):
            self.say(
                f"GUARD: the newest checkpoint ({chosen.source}) is not one this run saved "
                f"before step {bad_step}: not rolling back to it",
                flush=True,
            )
            return None
        return self.load(chosen)

    @staticmethod
    def _step_of(chosen: Chosen) -> int | None:
        if isinstance(chosen.source, MemoryChoice):
            return chosen.source.held.step
        return ckpt_files.parse_step(Path(chosen.source).name)

    def drain(self) -> None:
        """Sync saves leave nothing in flight."""

    def save_memory(self, step: int, tokens_seen: int, data: dict[str, Any]) -> None:
        if self.memory is not None and self.memory.enabled:
            started = time.perf_counter()
            self.memory.save(step, tokens_seen, data)
            self.memory_handover = time.perf_counter() - started
            self.base.own_steps.add(step)

    def before_update(self) -> None:
        if self.memory is None:
            return
        copied = self.memory.wait_copied()
        if copied is not None:  # the stall: the hand-over after the step, then this wait
            stall = self.memory_handover + copied.wait_seconds
            self.metrics.add_to_next("train/mem_ckpt_stall_seconds", stall)
            self.metrics.add_to_next("train/mem_ckpt_cpu_seconds", copied.background_seconds)
            self.costs[MEMORY] += stall + copied.background_seconds * copied.cpu_sharers
            self.metrics.add_to_next("train/mem_ckpt_copy_seconds", copied.copy_seconds)
            if copied.sealed is not None and copied.sealed > self.memory_said:
                # Sealed (checksummed, on the copy thread after the copy): a relaunch may
                # resume from it. Usually the copy before this one.
                self.memory_said = copied.sealed
                self.metrics.add_to_next("train/mem_ckpt_check_seconds", copied.check_seconds)
                self.beacon.ckpt(copied.sealed, "memory")
        if not self.memory.enabled and self.memory.off_reason:  # said once
            self.say(f"WARNING: memory tier off: {self.memory.off_reason}", flush=True)
            self.memory.off_reason = ""
        if self.memory.link is not None:
            self._partner_news(self.memory.link.stats())

    def _partner_news(self, now: PartnerStats) -> None:
        """What the partner copies did since the last step, on the next metrics record (only
        what changed); a skipped or refused copy said on this rank's output (every rank's, not
        only rank 0's) the first time and every tenth time after."""
        before, self.partner_seen = self.partner_seen, now
        for name in ("sent", "skipped", "received", "refused", "nbytes", "seconds"):
            delta = getattr(now, name) - (getattr(before, name) if before else 0)
            if delta:
                self.metrics.add_to_next(f"train/mem_partner_{name}", delta)
        for name, what, last in (
            ("skipped", "skipped a copy", now.last_skip),
            ("refused", "refused a copy received", now.last_refusal),
        ):
            count, was = getattr(now, name), getattr(before, name) if before else 0
            if count > was and (was == 0 or count // 10 > was // 10):  # every rank its own
                print(f"WARNING: memory tier: partner {what} ({last}); {count} so far", flush=True)

    def close(self, step: int) -> None:
        self.close_memory()

    def close_memory(self) -> None:
        """Without the supervisor a run that ends well removes its slots; under it they stay
        for a relaunch until the supervisor removes the job's directory."""
        if self.memory is not None:
            self.memory.close(remove=not os.environ.get(ENV_JOB_ID))

    def save(self, step: int, tokens_seen: int, data: dict[str, Any]) -> None:
        self.beacon.phase("save", step)
        try:
            self._save(step, tokens_seen, data)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            self._fail_if_full(exc, step)
            raise
        self.beacon.phase("train", step)

    def _say_complete(self, step: int) -> None:
        """Rank 0 alone says a checkpoint is complete: it wrote the marker. The others leave
        the save at the barrier before it, so their word could come before the marker exists
        (seen: a fault waiting for a complete step-10 fired, and the relaunch found step 5)."""
        if self.base.rank == 0:
            self.beacon.ckpt(step, "complete")

    def _fail_if_full(self, exc: BaseException, step: int) -> None:
        """A full or read-only disk: one line, exit 2, the partial save removed at once."""
        full = disk.storage_failure(exc, self.base.root, step)
        if full is not None:
            self.base.discard(step)
            raise full from None

    def _save(self, step: int, tokens_seen: int, data: dict[str, Any]) -> None:
        seconds = self.base.save(step, tokens_seen, data)
        self.metrics.add_to_next("train/ckpt_save_seconds", seconds)
        self.costs[DURABLE] += seconds
        self._say_complete(step)
        self.say(f"checkpoint step={step} saved in {seconds:.2f}s", flush=True)


class AsyncManager(SyncManager):
    """A save blocks the loop only to hand the state over and, before the next optimizer step,
    for what is left of the staging copy; the write, the fan-out to the durable dir and the
    marker follow in the background (`AsyncCheckpointer`)."""

    def __init__(
        self,
        base: Checkpointer,
        metrics: Timings,
        beacon: Reporter,
        say: Callable[..., None],
        memory_tier: MemoryTier | None,
        *,
        stage_root: Path,
        local_rank: int,
        timeout_s: float,
        hooks: SaveFailPoints,
    ):
        super().__init__(base, metrics, beacon, say, memory_tier)
        self._open_saver = partial(
            AsyncCheckpointer,
            base,
            stage_root=stage_root,
            local_rank=local_rank,
            timeout_s=timeout_s,
            hooks=hooks,
        )
        self.saver: AsyncCheckpointer | None = None  # from `start` on
        self.step = 0  # the loop's step, for the log line of a save that completes
        self.handover_seconds = 0.0

    def start(self) -> None:
        """Collective: the save thread's process groups; the node's stale stage dir cleaned."""
        self.saver = self._open_saver()

    def _save(self, step: int, tokens_seen: int, data: dict[str, Any]) -> None:
        self.step = step
        borrow = self.memory.lend(step) if self.memory is not None else None
        report = self.saver.save(step, tokens_seen, data, borrow)
        self._report(report.drained)
        self.handover_seconds = report.call_seconds
        if report.drained:
            self.metrics.add_to_next("train/ckpt_wait_seconds", report.wait_seconds)

    def before_update(self) -> None:
        super().before_update()
        staged = self.saver.wait_staged()
        if staged is None:
            return
        stall = self.handover_seconds + staged.wait_seconds
        self.metrics.add_to_next("train/ckpt_stage_seconds", stall)
        self.costs[DURABLE] += stall
        self.metrics.add_to_next("train/ckpt_stage_copy_seconds", staged.copy_seconds)
        self.beacon.ckpt(staged.step, "staged")
        self.say(
            f"checkpoint step={staged.step} staged ({staged.nbytes / 2**20:.1f} MiB, copy "
            f"{staged.copy_seconds:.3f}s beside training), loop blocked {stall:.3f}s",
            flush=True,
        )

    def poll(self, step: int) -> None:
        self.step = step
        report = self.saver.poll()
        if report is not None:
            self._report([report])

    def drain(self) -> None:
        self._report(self.saver.drain())

    def close(self, step: int) -> None:
        self.step = step
        self._report(self.saver.drain())
        self.saver.close()
        self.close_memory()

    def _report(self, reports: list[PollReport]) -> None:
        for r in reports:
            if r.written:
                self.beacon.ckpt(r.step, "written")
            if r.state is Readiness.READY:
                self.metrics.add_to_next("train/ckpt_drain_seconds", r.drain_seconds)
                self.metrics.add_to_next("train/ckpt_marker_seconds", r.save_to_marker_seconds)
                self._say_complete(r.step)
                self.say(
                    f"checkpoint step={r.step} complete at step={self.step} "
                    f"({r.save_to_marker_seconds:.2f}s after the save, "
                    f"drain {r.drain_seconds:.3f}s)",
                    flush=True,
                )
            elif r.state is Readiness.FAILED:
                if r.exception is not None:
                    self._fail_if_full(r.exception, r.step)
                self.say(f"WARNING: checkpoint step={r.step} failed: {r.error}", flush=True)

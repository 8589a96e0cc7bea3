"""Asynchronous checkpoints: stage to host memory, write locally, fan out, mark when ready.

Who does what (docs/checkpoints.md, asynchronous saves):
- main thread: `save` captures what is not a tensor (step, RNG, scheduler, data position) and
  hands the state to the save thread; `wait_staged`, called before the next optimizer step,
  blocks until the staging copy is done (parameters and moments change only in that step, so
  the copy overlaps the next forward and backward); `poll`, called every step while a save is
  in flight, asks every rank whether its copy is done and finalizes (meta.json + `.complete`)
  the moment all are.
- the save thread, per save: stages this rank's state into host buffers reused across saves,
  writes it with DCP to the node-local stage dir (DCP's collectives, plan and metadata exchange,
  run on `write_pg`, a gloo group that only this thread uses), then fans this rank's files out
  to the durable dir (no collectives).
- the readiness check runs on `control_pg`, another gloo group, used only by the main thread,
  so it can never cross-match a training collective or DCP's.
Every rank takes the same decision from the same all-reduced counts, so they finalize, fail or
keep waiting at the same step and the main-thread collectives stay in lockstep.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

from contracts import ckpt_files, scratch
from worker.ckpt import storage
from worker.ckpt.checkpointer import Checkpointer
from worker.ckpt.fail_points import NoFailPoints, SaveFailPoints
from worker.ckpt.fanout import FanoutResult, fan_out
from worker.ckpt.staging import Loan, ReusedStager

POLL_PAUSE_S = 0.005


def default_stage_root(ckpt_dir: str, job_id: str | None) -> Path:
    """Node-local scratch per job (`ckpt_files.job_tag`), one directory right under the temp dir
    whatever the job id holds (`scratch.scratch_tag`)."""
    tag = scratch.scratch_tag(ckpt_files.job_tag(ckpt_dir, job_id))
    return Path(tempfile.gettempdir()) / f"es-ckpt-{tag}"


class Readiness(Enum):
    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"


def readiness(finished: int, failed: int, world: int) -> Readiness:
    """Pure: from the all-reduced counts of ranks whose copy ended well or badly. A failure is
    declared only once every rank has stopped touching the directory."""
    if finished + failed < world:
        return Readiness.PENDING
    return Readiness.FAILED if failed else Readiness.READY


class _StageWriter(storage.RawWriter):
    """The checkpoint writer for the stage dir, with test hooks: a delay before it writes, a
    kill between this rank's shards and DCP's metadata."""

    def __init__(self, path: Path, after_data, delay_s: float = 0.0, **kw):
        super().__init__(path, **kw)
        self._after_data = after_data
        self._delay_s = delay_s

    def write_data(self, plan, planner):
        if self._delay_s:
            time.sleep(self._delay_s)  # test hook: the staged copy must not follow training
        written = super().write_data(plan, planner)
        self._after_data()
        return written


@dataclass
class InFlight:
    step: int
    meta: dict[str, Any]
    durable: Path
    stage: Path
    saved_at: float
    copy: Future  # of FanoutResult, on the save thread
    staged: threading.Event  # set once the save thread has copied the state (or failed to)
    announced: bool = False  # "written" reported for this rank
    stage_reported: bool = False  # wait_staged has returned for this save


@dataclass(frozen=True)
class PollReport:
    """What one readiness check found."""

    step: int
    written: bool  # this rank's durable copy just finished
    state: Readiness
    drain_seconds: float = 0.0  # main thread blocked on finalize
    save_to_marker_seconds: float = 0.0
    error: str | None = None
    exception: BaseException | None = None  # this rank's own failure, if it failed


@dataclass(frozen=True)
class SaveReport:
    """What the save call blocked: waiting for the previous save, then handing this one over."""

    wait_seconds: float
    call_seconds: float  # the handover (its part of the stage stall)
    drained: list[PollReport]  # how the previous save ended, when it was still in flight
    parts: dict[str, float]  # where the call seconds went


@dataclass(frozen=True)
class StagedReport:
    """What `wait_staged` blocked, and what the save thread's copy took."""

    step: int
    wait_seconds: float  # the other part of the stage stall
    copy_seconds: float  # the memcpy, overlapped with training
    nbytes: int


class AsyncCheckpointer:
    """The async save path around a `Checkpointer` (whose describe/finalize it reuses; resume
    is the `Checkpointer`'s own, from the durable dir only). Create it on every rank at start:
    it makes two gloo groups (a collective) and cleans the node's stage dir."""

    def __init__(
        self,
        base: Checkpointer,
        *,
        stage_root: Path,
        local_rank: int,
        timeout_s: float,
        hooks: SaveFailPoints | None = None,
    ):
        self.base = base
        self.world = base.world
        self.stage_root = stage_root
        self.local_rank = local_rank
        self.hooks = hooks or NoFailPoints()
        timeout = timedelta(seconds=timeout_s)
        self.write_pg = dist.new_group(backend="gloo", timeout=timeout)
        self.control_pg = dist.new_group(backend="gloo", timeout=timeout)
        self.inflight: InFlight | None = None
        self._step = -1
        self.stager = ReusedStager(on_staged=lambda: self.hooks.in_async_phase("stage", self._step))
        self._last_stage = (0.0, 0)  # (copy seconds, bytes) of the newest staging
        self._saving = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-save")
        self._retiring = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-retire")
        self.clean_stage_root()

    def clean_stage_root(self) -> None:
        """A dead attempt's stage copies are garbage: one rank per node removes them."""
        if self.local_rank == 0:
            shutil.rmtree(self.stage_root, ignore_errors=True)
            self.stage_root.mkdir(parents=True, exist_ok=True)
        dist.barrier(group=self.control_pg)

    # ---- saving -----------------------------------------------------------------------------
    @torch.no_grad()  # see Checkpointer.save
    def save(
        self,
        step: int,
        tokens_seen: int,
        data: dict[str, Any],
        borrow: Callable[[], Loan | None] | None = None,
    ) -> SaveReport:
        """Wait for a save still in flight, then hand this step to the save thread. The state
        must not change before `wait_staged` returns. `borrow`: the memory tier's copy of this
        very step, written out instead of staging a second copy (one copy per step)."""
        started = time.perf_counter()
        drained = self.drain()
        waited = time.perf_counter()
        self._step = step
        stage = ckpt_files.step_dir(self.stage_root, step)
        if self.local_rank == 0 and stage.exists():
            shutil.rmtree(stage)
        marks = [time.perf_counter()]
        durable = ckpt_files.step_dir(self.base.root, step)
        if self.base.rank == 0:
            # No barrier needed before other ranks write here: their fan-out starts after
            # DCP's write, whose collectives rank 0 joins only after this line.
            ckpt_files.prepare_step_dir(durable, sync_parent=False)
        marks.append(time.perf_counter())
        # This step's RNG and scheduler, now; every rank's RNG reaches rank 0 at finalize.
        meta = self.base.describe(step, tokens_seen, data, gather=False)
        marks.append(time.perf_counter())
        model_sd, optim_sd = get_state_dict(self.base.model, self.base.optimizer)
        marks.append(time.perf_counter())
        staged = threading.Event()
        state = {"model": model_sd, "optim": optim_sd}
        copy = self._saving.submit(
            self._stage_write_copy, state, staged, stage, durable, step, borrow
        )
        self.inflight = InFlight(step, meta, durable, stage, time.perf_counter(), copy, staged)
        done = time.perf_counter()
        names = ("prepare", "describe", "state_dict")
        parts = {n: b - a for n, a, b in zip(names, marks, marks[1:], strict=False)}
        parts["handover"] = done - marks[-1]
        return SaveReport(waited - started, done - waited, drained, parts)

    def wait_staged(self) -> StagedReport | None:
        """Before the optimizer step: block until the save in flight has copied the state
        (at once when the copy already ended during the forward and backward). A copy that
        failed is reported by `poll`, on every rank at the same step."""
        job = self.inflight
        if job is None or job.stage_reported:
            return None
        started = time.perf_counter()
        job.staged.wait()
        job.stage_reported = True
        return StagedReport(job.step, time.perf_counter() - started, *self._last_stage)

    @torch.no_grad()  # grad mode is per thread
    def _stage_write_copy(
        self,
        state: dict,
        staged: threading.Event,
        stage: Path,
        durable: Path,
        step: int,
        borrow: Callable[[], Loan | None] | None = None,
    ) -> FanoutResult:
        """Save thread: stage (or borrow the memory tier's copy), write the stage copy with
        DCP, copy this rank's files out."""
        loan = None
        try:
            loan = borrow() if borrow is not None else None
            if loan is None:
                snapshot = self.stager.stage(state)
                self._last_stage = (self.stager.copy_seconds, self.stager.nbytes)
            else:
                snapshot = loan.snapshot
                self._last_stage = (0.0, loan.nbytes)
                self.hooks.in_async_phase("stage", step)
        finally:
            staged.set()  # the main thread may go on (a failure shows in this future)
        try:
            self._write_stage(snapshot, stage, step, loan.padded if loan else self.stager.padded)
        finally:
            if loan is not None:
                loan.release()  # the memory tier may copy into that slot again
        result = fan_out(
            stage,
            durable,
            self.base.rank,
            with_crc=self.base.verify == "crc",
            midway=lambda: self.hooks.in_async_phase("fanout", step),
        )
        if self.base.rank == 0:
            ckpt_files.fsync_dir(durable.parent)  # the step dir's own entry, before any marker
        return result

    def _write_stage(self, snapshot: dict, stage: Path, step: int, padded) -> None:
        writer = _StageWriter(
            stage,
            after_data=lambda: self.hooks.in_async_phase("write", step),
            delay_s=self.hooks.write_delay_s,
            sync_files=False,  # scratch: the durable copy is the one fsynced
            padded=padded,  # O_DIRECT from the staging block
            before_write=partial(self.hooks.before_shard, step),
        )
        # The same state structure every save: DCP may reuse its plans (this thread's Python
        # takes turns with the training step's; planning afresh cost the step 0.26 s per save
        # of a 300 MB state here, cached plans 0.10 s).
        planner = DefaultSavePlanner(enable_plan_caching=True)
        dcp.save(snapshot, storage_writer=writer, process_group=self.write_pg, planner=planner)

    # ---- finishing --------------------------------------------------------------------------
    def poll(self) -> PollReport | None:
        """Every step: one tiny all-reduce on the control group while a save is in flight;
        finalize on every rank as soon as all copies are done."""
        job = self.inflight
        if job is None:
            return None
        written = job.copy.done() and not job.announced and job.copy.exception() is None
        job.announced = job.announced or written
        mine = _local_state(job.copy)
        counts = torch.tensor(mine, dtype=torch.int64)
        dist.all_reduce(counts, group=self.control_pg)
        state = readiness(int(counts[0]), int(counts[1]), self.world)
        if state is Readiness.PENDING:
            return PollReport(job.step, written, state)
        self.inflight = None
        if state is Readiness.FAILED:
            error = _error_text(job.copy)
            own = job.copy.exception() if job.copy.done() else None
            self._drop_stage(job)
            return PollReport(
                job.step, written, state, error=error or "failed on another rank", exception=own
            )
        started = time.perf_counter()
        self.hooks.in_async_phase("marker", job.step)
        result: FanoutResult = job.copy.result()
        self.base.finalize(
            job.durable,
            self.base.gather_rng(job.meta),
            local_crcs=result.crcs,
            retire=self._retiring.submit,
        )
        self.hooks.in_async_phase("after-marker", job.step)
        drained = time.perf_counter()
        self._drop_stage(job)
        return PollReport(
            job.step,
            written,
            state,
            drain_seconds=drained - started,
            save_to_marker_seconds=drained - job.saved_at,
        )

    def drain(self) -> list[PollReport]:
        """Block until the save in flight (if any) is marked or failed (at a save that comes
        while one is in flight, at the end of training, on a graceful stop)."""
        reports = []
        while self.inflight is not None:
            report = self.poll()
            reports.append(report)
            if report.state is Readiness.PENDING:
                time.sleep(POLL_PAUSE_S)
        return reports

    def _drop_stage(self, job: InFlight) -> None:
        """The stage copy is garbage once every rank's copy has ended (which the readiness
        check just established)."""
        if self.local_rank == 0:
            shutil.rmtree(job.stage, ignore_errors=True)

    def close(self) -> None:
        self._saving.shutdown(wait=True)
        self._retiring.shutdown(wait=True)
        self.stager.close()


def _local_state(copy: Future) -> list[int]:
    """[finished well, failed] for this rank's copy."""
    if not copy.done():
        return [0, 0]
    return [0, 1] if copy.exception() is not None else [1, 0]


def _error_text(copy: Future) -> str | None:
    if copy.done() and copy.exception() is not None:
        exc = copy.exception()
        return f"{type(exc).__name__}: {exc}"
    return None

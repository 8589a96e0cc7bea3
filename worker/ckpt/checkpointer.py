"""Sharded checkpoints with PyTorch Distributed Checkpoint: the sync save, and the load.

Every rank writes its own shards (no gather to rank 0) into `ckpt-dir/step-N/`; rank 0 then
writes `meta.json` (what the run needs besides tensors: step, tokens, RNG, data position,
scheduler, fingerprints, file sizes) and `.complete`, last and atomically. A load (of the
checkpoint `resume.choose` picked) goes into the already-sharded model and optimizer,
resharding through DCP when the world size or mesh differs.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from contracts import ckpt_files
from worker import collectives, lease
from worker.ckpt import rng, safe_load, storage
from worker.ckpt.fail_points import NoFailPoints, SaveFailPoints
from worker.ckpt.live_state import loaded_in_place, prefill_adamw_state
from worker.ckpt.ports import DataCheck, no_data_check
from worker.ckpt.resume import RunIdentity, start_reading
from worker.errors import UsageError


@dataclass
class Resumed:
    step: int
    tokens_seen: int
    path: Path
    source: str = "durable"  # or "memory": the node-local tier (worker.ckpt.memory)
    why: str | None = None  # what the memory tier passed over and why (resume.Chosen.why)
    data: dict[str, Any] | None = None  # the checkpoint's data record (skipped ranges, guard)


@contextmanager
def _no_collection() -> Iterator[None]:
    """No garbage collection while DCP plans and reads: its short-lived plan objects set off
    young-generation passes (5-10 ms of a 300 MB load here); once it returns, most are
    freed by reference counting and the deferred passes find little."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class Checkpointer:
    def __init__(
        self,
        root: Path,
        *,
        rank: int,
        world: int,
        device_type: str,
        identity: RunIdentity,
        keep: int,
        verify: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        hooks: SaveFailPoints | None = None,
        data_check: DataCheck = no_data_check,
    ):
        self.root = root
        self.rank, self.world = rank, world
        self.device_type = device_type
        self.identity = identity
        self.keep = keep
        self.verify = verify
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.hooks = hooks or NoFailPoints()
        self.data_check = data_check  # the loop's judge of a checkpoint's data record
        self.last_saved_step = -1
        self.own_steps: set[int] = set()  # loaded or saved by this process: the guard's rollback

    # ---- saving ---------------------------------------------------------------------------
    # Saving and loading run without autograd: a DTensor's `to_local()` then returns its shard
    # directly instead of going through an autograd function, and DCP calls it for every tensor
    # while planning and resolving (resolving alone took 13 ms of a 300 MB load here, now 4).
    @torch.no_grad()
    def save(self, step: int, tokens_seen: int, data: dict[str, Any]) -> float:
        """Write step-N on every rank, then mark it. Returns the seconds the loop was blocked."""
        started = time.perf_counter()
        directory = self.prepare(step)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        writer = storage.writer(directory, before_write=partial(self.hooks.before_shard, step))
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)
        self.hooks.after_write(step)
        self.finalize(directory, self.describe(step, tokens_seen, data))
        return time.perf_counter() - started

    def discard(self, step: int) -> None:
        """A save that cannot complete (its storage is full): its partial files and what was
        set aside go at once, since the disk needs the room; older checkpoints stay."""
        if self.rank == 0:
            ckpt_files.remove_step_dir(ckpt_files.step_dir(self.root, step))
            ckpt_files.remove_set_aside(self.root)

    def prepare(self, step: int) -> Path:
        """Empty the step directory (a stale marker first) before any rank writes into it."""
        directory = ckpt_files.step_dir(self.root, step)
        if self.rank == 0:
            ckpt_files.prepare_step_dir(directory)
        dist.barrier()
        return directory

    def describe(
        self, step: int, tokens_seen: int, data: dict[str, Any], gather: bool = True
    ) -> dict[str, Any]:
        """Everything besides tensors that the resumed run needs, as of `step` (call it at the
        step being saved: it captures the scheduler and, on rank 0's record, every rank's RNG).
        `gather=False` keeps just this rank's RNG and needs no collective; `gather_rng` then
        collects them later (the async path does so at finalize)."""
        mine = rng.capture(self.device_type)
        return {
            "step": step,
            "tokens_seen": tokens_seen,
            "world": self.world,
            "mesh": self.identity.mesh,
            "model_fingerprint": self.identity.model_fingerprint,
            "model": self.identity.model_description,
            "data": data,
            "scheduler": self.scheduler.state_dict(),
            "rng": self._gather(mine) if gather else mine,
        }

    def gather_rng(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Collective: a `describe(gather=False)` record with every rank's RNG on rank 0."""
        return {**meta, "rng": self._gather(meta["rng"])}

    def finalize(
        self,
        directory: Path,
        meta: dict[str, Any],
        local_crcs: dict[str, int] | None = None,
        retire: Callable[[Callable[[], None]], None] = lambda job: job(),
    ) -> None:
        """Collective: once every rank's shards are durable in `directory`, rank 0 records the
        files and writes the marker, then applies retention. `local_crcs`: checksums this rank
        already computed while copying its own files (async path); else they are read here.
        `retire` runs the deletion of old checkpoints (the async path hands it to a background
        thread: it is pure file I/O, decided here, after the marker)."""
        crcs = None
        if self.verify == "crc":
            crcs = self._checksums(directory) if local_crcs is None else self._merge(local_crcs)
        dist.barrier()
        if self.rank == 0:
            ckpt_files.fsync_dir(directory)
            meta = {
                **meta,
                "saved_at": time.time(),
                "writer": ckpt_files.writer_of(os.environ, lease.epoch()),
                "files": ckpt_files.record_files(directory, crcs),
            }
            lease.guard()  # a fenced rank stamps no marker
            ckpt_files.mark_complete(directory, meta)
            doomed = ckpt_files.retention_plan(ckpt_files.scan(self.root), self.keep)

            def tidy() -> None:
                ckpt_files.remove(doomed)
                ckpt_files.remove_set_aside(self.root)

            retire(tidy)
        self.last_saved_step = meta["step"]
        self.own_steps.add(meta["step"])

    def _gather(self, item: Any) -> list[Any] | None:
        return collectives.gather_json(item, dst=0)

    def _checksums(self, directory: Path) -> dict[str, int]:
        """Each rank checksums every world-th file, so the cost is spread like the writes."""
        names = sorted(p.name for p in directory.iterdir() if p.is_file())
        return self._merge(
            {n: ckpt_files.file_crc(directory / n) for n in names[self.rank :: self.world]}
        )

    def _merge(self, mine: dict[str, int]) -> dict[str, int]:
        return {k: v for part in collectives.all_gather_json(mine) for k, v in part.items()}

    # ---- resuming ---------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, directory: Path) -> Resumed:
        meta = ckpt_files.read_meta(directory)
        if meta["model_fingerprint"] != self.identity.model_fingerprint:
            raise UsageError(
                f"checkpoint {directory} is of another model ({meta['model']}); this run builds "
                f"{self.identity.model_description}. Point --ckpt-dir elsewhere, or pass "
                "--no-resume to start fresh"
            )
        problem = self.data_check(meta.get("data"))
        if problem is not None:  # every rank reads the same meta.json: every rank refuses
            raise UsageError(
                f"checkpoint {directory}: its data record is damaged ({problem}); remove "
                f"{directory.name} to resume from the one before, or pass --no-resume"
            )
        start_reading(directory, meta, rank=self.rank, identity=self.identity)  # while planning
        prefill_adamw_state(self.optimizer)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        # Each rank plans its own reads from DCP's metadata: a load's global plan is the local
        # plans unchanged, so gathering them on rank 0 would only cost time at scale.
        with _no_collection():
            dcp.load(
                state,
                storage_reader=storage.reader(directory),
                planner=safe_load.SafeLoadPlanner(),
                no_dist=True,
            )
        storage.stop_read_ahead(directory / storage.shard_name(self.rank))
        if not loaded_in_place(self.model, state["model"]):
            set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        self.scheduler.load_state_dict(meta["scheduler"])
        rngs = meta.get("rng") or []
        if self.rank < len(rngs) and meta["world"] == self.world:
            rng.restore(rngs[self.rank], f"{directory / ckpt_files.META} (rank {self.rank})")
        self.last_saved_step = meta["step"]
        self.own_steps.add(meta["step"])
        return Resumed(
            step=meta["step"],
            tokens_seen=meta["tokens_seen"],
            path=directory,
            data=meta.get("data"),
        )

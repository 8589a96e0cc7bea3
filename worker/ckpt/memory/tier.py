"""The memory tier while training: each rank copies its state into its two slots in turn, on a
thread of its own, beside the next step's forward and backward; the same thread checksums the
copy and seals the slot. Also the load of a slot the ranks agreed on, and whether both slots fit.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from contracts import ckpt_files, locks
from worker import collectives, lease, priority
from worker.ckpt import rng
from worker.ckpt.fail_points import SaveFailPoints
from worker.ckpt.live_state import loaded_in_place, prefill_adamw_state
from worker.ckpt.memory.checksum import checked
from worker.ckpt.memory.held import Held, find, forget, hold, release
from worker.ckpt.memory.partner_link import PartnerLink, connect_partners
from worker.ckpt.memory.slot_copy import CopyJob, SlotStager
from worker.ckpt.memory.slot_file import (
    HEADER_BYTES,
    SLOTS,
    Expect,
    MappedSlot,
    SlotRefused,
    rank_dir,
    read_header,
    read_into,
    slot_paths,
)
from worker.ckpt.memory.state_view import StateView
from worker.ckpt.memory.thread_cpu import ThreadCpu, cpu_sharers
from worker.ckpt.staging import Loan, bytes_needed

# Free shared memory left after both slots of every rank on the node: a tmpfs filled to the
# brim takes the node's memory with it.
FREE_MARGIN_FRACTION = 0.10
FREE_MARGIN_MIN_BYTES = 256 * 2**20


@dataclass(frozen=True)
class CopyReport:
    step: int
    wait_seconds: float  # what the loop blocked for the copy
    copy_seconds: float  # the memcpy, beside training
    nbytes: int
    sealed: int | None  # the newest step sealed so far (its checksum follows its copy)
    check_seconds: float | None  # that seal's checksum, on the copy thread
    # The tier's threads' CPU since the report before (the copy, the seal and partner send of
    # the copy before, partner receipts) but while the loop waited: on CPU, taken from the
    # steps beside them (`thread_cpu`); 0 when the state is on a device.
    background_seconds: float = 0.0
    cpu_sharers: int = 1  # the ranks whose threads' CPU this rank's stands for (`thread_cpu`)


class MemoryTier:
    """Copies this rank's state into its two slots in turn, on a thread of its own, beside the
    next step's forward and backward (the optimizer step waits for the copy, as for the async
    stage); the same thread then checksums the copy and seals the slot, while training goes on."""

    def __init__(
        self,
        directory: Path,
        expect: Expect,
        *,
        interval: int,
        local_world: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        describe,
        hooks: SaveFailPoints,
        partner: bool = False,
        node: str = "",
    ):
        self.directory, self.expect = directory, expect
        self.interval, self.local_world = interval, local_world
        self.model, self.optimizer = model, optimizer
        self.describe = describe  # (step, tokens, data, gather=False) -> meta without tensors
        self.hooks = hooks
        self.partner_wanted, self.node = partner, node
        self.link: PartnerLink | None = None  # set up at the first copy (collective)
        self.enabled = True  # until the first copy's collective check says otherwise
        self.fit_checked = False
        self.off_reason = ""
        self.rank_dir = rank_dir(directory, expect.rank)
        try:
            hold(directory)
            self.rank_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.broken = None
        except OSError as exc:  # every rank still joins the check, which turns the tier off
            self.broken = f"{directory} cannot be used ({exc.strerror or exc})"
        self.slots = [MappedSlot(*slot_paths(directory, expect.rank, s)) for s in range(SLOTS)]
        self.stagers = [SlotStager(allocate=slot.map) for slot in self.slots]
        self.cpu = ThreadCpu()  # the tier's threads: what they take from training on CPU
        self.cpu_charged = _on_cpu(model)
        self._cpu_seen = 0.0
        self.cpu_sharers = 1  # counted at the first copy (`check_fit`)
        self.view = StateView(model, optimizer)  # taken once, handed again while it is live
        held, _ = find(directory, expect) if self.broken is None else ([], [])
        self.gen = 1 + max((h.gen for h in held), default=0)
        self.target = (held[0].slot + 1) % SLOTS if held else 0  # never the newest complete
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mem-ckpt", initializer=self.cpu.add_current
        )
        # The copy's pieces, on CPU time nothing else wants; the loop finishes what is left.
        self._worker = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="mem-copy", initializer=self._worker_started
        )
        self._job: CopyJob | None = None  # the copy in flight's pieces, once it has started
        self._published = threading.Event()  # set once they are (or the copy is over)
        self._copy: Future | None = None
        self._copy_step = -1
        self._copied = threading.Event()
        # Written by the copy thread once a slot is sealed (or its seal failed), read by the loop.
        self.sealed: int | None = None
        self.check_seconds: float | None = None
        self._seal_failed: str | None = None
        # Per slot, set once no writer reads it: an async durable save may write one out.
        # Each loan gets an event of its own, so a copy waits only for loans made before it.
        self._free = [threading.Event() for _ in range(SLOTS)]
        for free in self._free:
            free.set()

    # ---- set-up ----------------------------------------------------------------------------------
    def check_fit(self, state: dict[str, Any]) -> str | None:
        """Collective, at the first copy (before it, the optimizer holds no state to measure,
        and asking DCP for its state dict then would take a step): both slots must fit in this
        node's free shared memory with a margin, on every node, else the tier is off everywhere.
        Returns why it is off."""
        need = bytes_needed(state) + HEADER_BYTES
        copies = self.local_world
        if self.partner_wanted:  # and the copies this node holds for other nodes' ranks
            self.link, held = connect_partners(
                self.directory, self.expect, self.node, need, self.hooks, self.cpu
            )
            copies += held if self.link is not None else 0
        problem = self.broken or fit_problem(
            self.directory, need * SLOTS * copies, self._reusable()
        )
        ok = collectives.all_true(not problem)
        self.cpu_sharers = host_sharers() if self.cpu_charged else 1  # every rank joins
        if ok:
            return None
        self.enabled = False
        self.off_reason = problem or "another node lacks the shared memory for both slots"
        self.close(remove=True)
        return self.off_reason

    def _worker_started(self) -> None:
        priority.lowest_priority()
        self.cpu.add_current()

    def _reusable(self) -> int:
        """Bytes of slot files already there (this job's, on this node): reused, not added."""
        return sum(p.stat().st_size for p in self.directory.glob("**/rank-*/slot-*.bin"))

    # ---- saving ----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.enabled and step % self.interval == 0

    @torch.no_grad()
    def save(self, step: int, tokens_seen: int, data: dict[str, Any]) -> None:
        """Hand the state as of the end of `step` to the copy thread; it must not change before
        `wait_copied` returns."""
        state = self.view.get()
        if not self.fit_checked:
            self.fit_checked = True
            if self.check_fit(state):
                return
        meta = self.describe(step, tokens_seen, data, gather=False)
        self._copied.clear()
        self._published.clear()
        self._job = None
        self._copy_step = step
        slot, gen = self.target, self.gen
        self._copy = self._thread.submit(self._copy_into, slot, gen, state, meta, self._free[slot])
        self._thread.submit(self._check_and_seal, slot, gen, meta, self._copy)
        self.target = (self.target + 1) % SLOTS
        self.gen += 1

    @torch.no_grad()  # grad mode is per thread
    def _copy_into(
        self,
        slot: int,
        gen: int,
        state: dict[str, Any],
        meta: dict[str, Any],
        free: threading.Event,
    ) -> dict[str, Any]:
        """The copy: its pieces to the copy worker (and the loop, if it must wait), then the
        rest; once it is done the loop may change the live state again."""
        try:
            target, stager = self.slots[slot], self.stagers[slot]
            free.wait()  # an async durable save still writing this slot's older copy out
            job = stager.start(state)  # maps the slot on its first use
            target.begin(gen)  # from here the slot is torn until sealed
            self._job = job
            self._published.set()
            self._worker.submit(job.work)
            snapshot = stager.finish(state, job)
            self.hooks.in_memory_copy(meta["step"])
            return snapshot
        finally:
            self._job = None
            self._published.set()
            self._copied.set()

    @torch.no_grad()
    def _check_and_seal(self, slot: int, gen: int, meta: dict[str, Any], copy: Future) -> None:
        """After the copy, on the same thread (before the next copy), training going on: the
        checksums, then the record and the closing generation. A failure turns the tier off at
        the loop's next look (`wait_copied`); the slot stays torn."""
        if copy.exception() is not None:  # said by wait_copied
            return
        try:
            target, stager = self.slots[slot], self.stagers[slot]
            started = time.perf_counter()
            record = {
                **self.expect.record(),
                "gen": gen,
                "step": meta["step"],
                "nbytes": stager.nbytes,
                "meta": meta,
                "table": stager.table(copy.result()),  # digests from the copy's page sums
                "saved_at": time.time(),
                "writer": ckpt_files.writer_of(os.environ, lease.epoch()),
            }
            record = checked(record)
            check_seconds = time.perf_counter() - started
            target.seal(gen, record)
            self.check_seconds, self.sealed = check_seconds, meta["step"]
            if self.link is not None:  # to the partner, in the background
                self.link.offer(record, target.block[: stager.nbytes])
        except Exception as exc:  # any failure: the tier goes off, training goes on
            self._seal_failed = f"a seal failed ({type(exc).__name__}: {exc})"

    def lend(self, step: int) -> Callable[[], Loan | None] | None:
        """The copy of `step` in flight, for an async durable save of the same step to write
        out (one copy per step, not two); None when this step has none. The slot is not
        copied into again until the loan is released."""
        if self._copy is None or self._copy_step != step:
            return None
        slot, job = (self.target - 1) % SLOTS, self._copy
        released = threading.Event()
        self._free[slot] = released  # the next copy into this slot waits for it

        def borrow() -> Loan | None:
            if job.exception() is not None:  # waits for the copy; it failed: stage afresh
                released.set()
                return None
            stager = self.stagers[slot]
            return Loan(stager.staged, stager.padded, stager.nbytes, released.set)

        return borrow

    def wait_copied(self) -> CopyReport | None:
        """Before the optimizer step: block until the copy in flight is done. A copy that
        failed turns the tier off with one warning (the durable tier goes on)."""
        job = self._copy
        if job is None:
            return None
        started = time.perf_counter()
        before = self.cpu.seconds() if self.cpu_charged else 0.0
        self._finish_copy()
        waited = time.perf_counter() - started
        self._copy = None
        error = job.exception()
        if error is not None or self._seal_failed:
            self.enabled = False
            self.off_reason = self._seal_failed or (
                f"a copy failed ({type(error).__name__}: {error})"
            )
            return None
        stager = self.stagers[(self.target - 1) % SLOTS]
        # Not what the threads ran while the loop waited for them: that is in the stall (0 where
        # the CPU is not charged: both reads are 0).
        background = max(0.0, before - self._cpu_seen)
        self._cpu_seen = self.cpu.seconds() if self.cpu_charged else 0.0
        return CopyReport(
            self._copy_step, waited, stager.copy_seconds, stager.nbytes, self.sealed,
            self.check_seconds, background, self.cpu_sharers,
        )  # fmt: skip

    def _finish_copy(self) -> None:
        """Block until the copy in flight is done, doing what is left of it on this thread."""
        self._published.wait()  # behind the seal before it, at the copy thread's priority
        job = self._job
        if job is not None:
            job.work()
        self._copied.wait()

    def resumed_from(self, held: Held) -> None:
        """A load of `held` succeeded: the next copy goes into the other slot (the one resumed
        from stays whole meanwhile), with a generation newer than every slot's."""
        self.target = (held.slot + 1) % SLOTS
        self.gen = max(self.gen, held.gen + 1)

    def close(self, remove: bool) -> None:
        """Wait for a copy in flight; with `remove`, delete this rank's slots (and the job's
        directory when no one else holds it)."""
        if self._copy is not None:
            self._finish_copy()
            self._copy = None
        self._thread.shutdown(wait=True)
        self._worker.shutdown(wait=True)
        if self.link is not None:
            self.link.close()
        for stager in self.stagers:
            stager.close()
        for slot in self.slots:
            slot.header = slot.block = None
        if remove:
            forget(self.directory, self.expect.rank)
            release(self.directory)
            fd = locks.take_if_abandoned(self.directory)
            if fd is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
                os.close(fd)

    def forget_slot(self, held: Held) -> None:
        """A slot that failed to load: gone, so that no later agreement picks it again."""
        for path in slot_paths(self.directory, self.expect.rank, held.slot):
            path.unlink(missing_ok=True)

    # ---- resuming --------------------------------------------------------------------------------
    @torch.no_grad()
    def load(self, held: Held, scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, Any]:
        """The slot's state into the live model, optimizer, scheduler and RNGs (same world and
        mesh: each local tensor is read straight from the slot). Returns its meta record."""
        prefill_adamw_state(self.optimizer)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        flat, mapping = flatten_state_dict({"model": model_sd, "optim": optim_sd})
        try:
            read_into(held.path, flat, held.record["table"])
        except SlotRefused as exc:
            raise SlotRefused(f"slot {held.slot} (step {held.step}): {exc}") from None
        state = unflatten_state_dict(flat, mapping)
        if not loaded_in_place(self.model, state["model"]):
            set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        meta = held.record["meta"]
        scheduler.load_state_dict(meta["scheduler"])
        rng.restore(meta["rng"], f"{held.path} (rank {self.expect.rank})")
        before, after, _ = read_header(held.path)
        if not before == after == held.gen:
            raise SlotRefused(f"slot {held.slot} (step {held.step}): changed while it was read")
        return meta


def fit_problem(directory: Path, need: int, reusable: int) -> str | None:
    """Why `need` bytes of slots do not fit in the file system of `directory` (None: they do)."""
    st = os.statvfs(directory)
    return room_problem(
        need, st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize, reusable, directory.parent
    )


def room_problem(need: int, total: int, free: int, reusable: int, where: Path) -> str | None:
    """Pure: whether `need` bytes fit in `free` (plus `reusable`, slot files already there),
    leaving a margin of the file system's `total` free."""
    room = free + reusable
    margin = max(FREE_MARGIN_MIN_BYTES, int(total * FREE_MARGIN_FRACTION))
    if need + margin <= room:
        return None
    gib = 2**30
    return (
        f"both slots of this node's ranks need {need / gib:.2f} GiB in {where}, which has "
        f"{room / gib:.2f} GiB free (keeping {margin / gib:.2f} GiB spare); training without "
        "the memory tier (make room, or set ES_MEM_ROOT to a larger tmpfs)"
    )


def host_sharers() -> int:
    """Collective: `cpu_sharers` for this rank, from the job's ranks on its host (by host name)
    and the cores each may run on."""
    here, mask = socket.gethostname(), sum(1 << core for core in os.sched_getaffinity(0))
    every = collectives.all_gather_json([here, hex(mask)])
    host = [int(theirs, 16) for name, theirs in every if name == here]
    return cpu_sharers(mask, torch.get_num_threads(), host)


def on_everywhere(tier: MemoryTier) -> bool:
    """Collective: whether the tier is on at every rank (a copy or seal that failed turns it off
    at that rank alone; a choice among its slots is a collective of all or none)."""
    return collectives.all_true(tier.enabled)


def _on_cpu(model: torch.nn.Module) -> bool:
    """Whether the state lives on CPU: there the training keeps the cores busy, and what the
    tier's threads run is taken from it (on a device, a copy is a transfer the cores wait on)."""
    first = next(model.parameters(), None)
    return first is None or first.device.type == "cpu"

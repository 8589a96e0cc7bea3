"""The memory tier: every `--mem-ckpt-interval` steps each rank copies its own shard of the whole
training state into node-local shared memory, which outlives the rank; a relaunch on the same
nodes resumes from it when every rank holds the same newer step (docs/checkpoints.md).

Layout, one directory per job on each node (0700; files 0600):
```
<ES_MEM_ROOT or /dev/shm>/es-mem-<job>/  .es-lock  rank-<R>/slot-<0|1>.bin  slot-<0|1>.json
```
A slot's `.bin` is a header page (magic, generation written before the copy, generation written
after it) and then the tensors' bytes, mapped once and reused by every copy (the async stage's
`ReusedStager`, its block being this mapping). Its `.json` (replaced atomically, after the bytes)
names the generation, the step, the run identity, where each tensor lies, and what is not a tensor
(scheduler, RNG, data position). A slot is complete only when both generations in the header
equal the record's: a rank killed mid-copy leaves a torn slot that never passes, and its other
slot, the previous copy, stays whole. The two slots alternate.

Checked: each tensor's entry holds its bytes' `digest`, one per 4 MiB (`page_sums_crc`: the
CRC-32 of its 4 KiB page sums, each page's 64-bit words added mod 2**64), computed on the copy
thread once the copy is done (the loop does not wait for it), and the record its own CRC-32
(`check`), all written before the closing generation. A load checks each piece of a tensor as
it reads it (its sums taken while it is in the cache); a slot that fails is refused, and the
ranks choose again (`resume.choose_tiers`). Against damage, not an adversary who can write the
files: one changed 64-bit word is always caught; a page's words swapped among themselves, or
two changes that cancel in a page's sum, are not.

Nothing here is unpickled: the record is JSON, the tensors raw bytes read into the live state.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.state_dict import (
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from contracts import locks, scratch
from worker import collectives
from worker.ckpt import rng
from worker.ckpt.live_state import loaded_in_place, prefill_adamw_state
from worker.ckpt.staging import Loan, ReusedStager, bytes_needed
from worker.hooks import Hooks

FORMAT = "es-mem-2"  # es-mem-1: no checksums
MAGIC = b"ESMEMSL1"
HEADER_BYTES = 4096  # magic, generation before, generation after, data bytes; then padding
_HEADER = struct.Struct("<8sQQQ")
SLOTS = 2
# Free shared memory left after both slots of every rank on the node: a tmpfs filled to the
# brim takes the node's memory with it.
FREE_MARGIN_FRACTION = 0.10
FREE_MARGIN_MIN_BYTES = 256 * 2**20
# The data's checksum: one digest per chunk (verified, then copied out, while in the cache).
CHECK_ALGO = "page-sums-crc32"
CHECK_CHUNK = 4 << 20
PAGE_BYTES = 4096
# The longest reason a rank tells the others (a refused slot's, for the `resumed` event).
REASON_BYTES = 400
READ_PIECE = 1 << 20  # read, then summed while in the cache
MAX_RECORD_BYTES = 256 << 20
_HEX = re.compile(r"[0-9a-f]*")

_held: dict[str, int] = {}  # job dir -> the shared lock this process holds on it


class SlotRefused(Exception):
    """A slot that is not a complete copy of this run's state (said why)."""


@dataclass(frozen=True)
class Expect:
    """What a slot must match to be resumed by this rank (the mesh and world: a memory copy is
    never resharded; the node: another node's memory is not this one's)."""

    job: str
    rank: int
    world: int
    mesh: str
    model_fingerprint: str
    host: str

    def record(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.__dict__}


@dataclass(frozen=True)
class Held:
    """A complete slot of this rank."""

    slot: int
    step: int
    gen: int
    record: dict[str, Any]
    path: Path  # the .bin


@dataclass(frozen=True)
class MemoryChoice:
    """Every rank resumes from its own slot of `step`."""

    step: int
    held: Held


def job_dir(env: dict[str, str] | os._Environ, tag: str) -> Path:
    return Path(scratch.mem_dir(scratch.mem_root(env), tag))


def hold(directory: Path) -> None:
    """Hold the job's directory (shared) for this process's life: no sweep removes it meanwhile."""
    key = str(directory)
    if key not in _held:
        _held[key] = locks.hold_mem_dir(directory)


def release(directory: Path) -> None:
    fd = _held.pop(str(directory), None)
    if fd is not None:
        os.close(fd)


def rank_dir(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}"


def slot_paths(directory: Path, rank: int, slot: int) -> tuple[Path, Path]:
    base = rank_dir(directory, rank)
    return base / f"slot-{slot}.bin", base / f"slot-{slot}.json"


# ---- reading what a rank holds ---------------------------------------------------------------
def open_slot_file(path: Path) -> int:
    """A read-only descriptor of a slot's file: a regular file itself (never through a symlink,
    never a FIFO that would block the open), else SlotRefused. OSError as os.open raises it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SlotRefused(f"{path.name}: not a regular file")
    return fd


def read_header(path: Path) -> tuple[int, int, int]:
    """(generation before, generation after, data bytes) of a slot file; SlotRefused if it has
    none."""
    fd = open_slot_file(path)
    try:
        raw = os.pread(fd, _HEADER.size, 0)
    finally:
        os.close(fd)
    if len(raw) < _HEADER.size:
        raise SlotRefused(f"{path.name}: no header")
    magic, before, after, nbytes = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise SlotRefused(f"{path.name}: not a memory slot")
    return before, after, nbytes


def _read_record(path: Path) -> bytes:
    fd = open_slot_file(path)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_RECORD_BYTES:
            raise SlotRefused(f"{path.name}: {size} bytes, more than a record's")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)


def inspect(directory: Path, rank: int, slot: int, expect: Expect) -> Held:
    """The slot if it is a complete copy of this run's state for this rank; else SlotRefused
    naming why (torn, another world, another node, …)."""
    bin_path, json_path = slot_paths(directory, rank, slot)
    try:
        before, after, nbytes = read_header(bin_path)
        record = json.loads(_read_record(json_path))
        size = bin_path.stat().st_size
    except FileNotFoundError:
        raise SlotRefused(f"slot {slot}: missing") from None
    except (OSError, ValueError) as exc:
        raise SlotRefused(f"slot {slot}: unreadable ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("gen"), int):
        raise SlotRefused(f"slot {slot}: no record")
    if record.get("format") != FORMAT:
        raise SlotRefused(f"slot {slot}: format {record.get('format')!r}, this run {FORMAT!r}")
    problem = record_problem(record)
    if problem:
        raise SlotRefused(f"slot {slot}: {problem}")
    if not before == after == record["gen"]:
        raise SlotRefused(f"slot {slot}: torn (a copy was cut short)")
    if size != HEADER_BYTES + nbytes or record.get("nbytes") != nbytes:
        raise SlotRefused(f"slot {slot}: {size} bytes, its record says {nbytes}")
    for key, value in expect.record().items():
        if record.get(key) != value:
            raise SlotRefused(f"slot {slot}: {key} {record.get(key)!r}, this run {value!r}")
    if not isinstance(record.get("step"), int) or not isinstance(record.get("table"), dict):
        raise SlotRefused(f"slot {slot}: incomplete record")
    outside = table_problem(record["table"], nbytes)
    if outside:
        raise SlotRefused(f"slot {slot}: {outside}")
    return Held(slot, record["step"], record["gen"], record, bin_path)


# ---- the checksums -------------------------------------------------------------------------------
def page_sums_crc(data: torch.Tensor, crc: int = 0) -> int:
    """`crc` carried over `data`'s 4 KiB page sums (each page's little-endian 64-bit words added
    mod 2**64; a last partial page counts as zero-padded). `data`: host uint8, whole pages but
    at its end. One pass at memory speed (a torch reduction); a changed word changes its sum."""
    data = data.detach()
    n = data.numel()
    whole = n - n % PAGE_BYTES
    if whole:
        pages = data[:whole]
        try:
            words = pages.view(torch.int64)
        except RuntimeError:  # not on an 8-byte boundary: an aligned copy
            words = pages.clone().view(torch.int64)
        crc = zlib.crc32(words.view(-1, PAGE_BYTES // 8).sum(dim=1).numpy(), crc)
    if whole < n:
        page = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
        page[: n - whole] = data[whole:]
        crc = zlib.crc32(page.view(torch.int64).sum().reshape(1).numpy(), crc)
    return crc


def digest(data: torch.Tensor) -> str:
    """A tensor's checksum (`data`: its bytes, host uint8): one CRC-32 of page sums
    (`page_sums_crc`) per CHECK_CHUNK bytes, 8 hex digits each."""
    n = data.numel()
    return "".join(
        f"{page_sums_crc(data[o : o + CHECK_CHUNK]):08x}" for o in range(0, n, CHECK_CHUNK)
    )


def digest_problem(value: Any, nbytes: int) -> str | None:
    """Pure: why `value` cannot be the digest of `nbytes` bytes (None: it can)."""
    if not isinstance(value, str) or len(value) != 8 * -(-nbytes // CHECK_CHUNK):
        return f"its checksum does not cover its {nbytes} bytes"
    if not _HEX.fullmatch(value):
        return "its checksum is not hexadecimal"
    return None


def _canonical(record: dict[str, Any]) -> bytes:
    """The record's bytes for its CRC: all of it but that CRC (`check.record`), keys sorted."""
    check = record.get("check")
    body = {**record, "check": {k: v for k, v in check.items() if k != "record"}}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def checked(record: dict[str, Any]) -> dict[str, Any]:
    """`record` as it is written: JSON through and through (it reads back the same), with its
    `check`: the checksum's kind and the CRC-32 of the whole record but that CRC (the tensors'
    digests are in the table)."""
    plain = json.loads(json.dumps(record))
    plain["check"] = {"algo": CHECK_ALGO, "chunk_bytes": CHECK_CHUNK}
    plain["check"]["record"] = zlib.crc32(_canonical(plain))
    return plain


def record_problem(record: dict[str, Any]) -> str | None:
    """Pure: why a slot's record is not as it was written (None: it is)."""
    check = record.get("check")
    if not isinstance(check, dict):
        return "its record has no checksum"
    if check.get("algo") != CHECK_ALGO or check.get("chunk_bytes") != CHECK_CHUNK:
        return f"checksum {check.get('algo')!r} of {check.get('chunk_bytes')!r} bytes unknown"
    if check.get("record") != zlib.crc32(_canonical(record)):
        return "its record fails its checksum (changed since it was written)"
    return None


def table_problem(table: dict[str, Any], nbytes: int) -> str | None:
    """Pure: what in a slot's table points outside its `nbytes` of data (None: nothing)."""
    for key, entry in table.items():
        if not isinstance(entry, dict):
            return f"entry {key!r} is not a record"
        if "offset" not in entry:
            continue
        offset, size = entry.get("offset"), entry.get("nbytes")
        if not (isinstance(offset, int) and isinstance(size, int)):
            return f"entry {key!r} has no integer offset and size"
        if offset < 0 or size < 0 or offset + size > nbytes:
            return f"entry {key!r} lies outside the slot ({offset}+{size} > {nbytes})"
        unchecked = digest_problem(entry.get("digest"), size)
        if unchecked:
            return f"entry {key!r}: {unchecked}"
    return None


def find(directory: Path, expect: Expect) -> tuple[list[Held], list[str]]:
    """This rank's complete slots, newest first, and why the others were refused."""
    held, refused = [], []
    for slot in range(SLOTS):
        try:
            held.append(inspect(directory, expect.rank, slot, expect))
        except SlotRefused as exc:
            refused.append(str(exc))
    return sorted(held, key=lambda h: h.step, reverse=True), refused


def newest_common(steps_per_rank: list[list[int]]) -> int | None:
    """Pure: the newest step that every rank holds complete; None when there is none."""
    if not steps_per_rank:
        return None
    common = set(steps_per_rank[0]).intersection(*map(set, steps_per_rank[1:]))
    return max(common) if common else None


@dataclass(frozen=True)
class Agreement:
    step: int | None  # the newest step every rank holds complete
    without: list[int]  # ranks that hold no complete slot
    durable: int | None  # the newest complete durable step (rank 0's scan)

    @property
    def use_memory(self) -> bool:
        """Memory only when it is newer than the durable tier (docs/checkpoints.md)."""
        return self.step is not None and (self.durable is None or self.step > self.durable)


def agree(held: list[Held], world: int, newest_durable: int | None) -> Agreement:
    """Collective, one all-gather: every rank's complete steps, and rank 0's newest durable
    step, so that every rank takes the same decision."""
    mine = torch.full((SLOTS + 1,), -1, dtype=torch.int64, device=collectives.group_device())
    for i, h in enumerate(held[:SLOTS]):
        mine[i] = h.step
    if newest_durable is not None:
        mine[SLOTS] = newest_durable
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    every = [t.tolist() for t in every]
    steps = [[s for s in t[:SLOTS] if s >= 0] for t in every]
    durable = int(every[0][SLOTS])
    return Agreement(
        newest_common(steps),
        [r for r, s in enumerate(steps) if not s],
        durable if durable >= 0 else None,
    )


def first_refusal(reason: str | None) -> str | None:
    """Collective: `rank R: <reason>` of the lowest rank that gives one (and how many more
    did), the same text on every rank; None, on every rank, when none gives one."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = collectives.group_device()
    first = torch.tensor([rank if reason else world], dtype=torch.int64, device=device)
    count = torch.tensor([1 if reason else 0], dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    dist.all_reduce(count, op=dist.ReduceOp.SUM)
    first_rank, how_many = int(first.item()), int(count.item())
    if how_many == 0:
        return None
    text = torch.zeros(REASON_BYTES, dtype=torch.uint8)
    if rank == first_rank:
        raw = reason.encode()[:REASON_BYTES]
        text[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    text = text.to(device)
    dist.broadcast(text, src=first_rank)
    said = bytes(text.cpu().tolist()).rstrip(b"\0").decode(errors="replace")
    more = how_many - 1
    return f"rank {first_rank}: {said}" + (
        f" (and {more} more rank{'s' if more > 1 else ''})" if more else ""
    )


def forget(directory: Path, rank: int) -> None:
    """Remove this rank's slots (a fresh start must not later resume another timeline's)."""
    shutil.rmtree(rank_dir(directory, rank), ignore_errors=True)


# ---- the tier while training -------------------------------------------------------------------
class _Slot:
    """One slot file, mapped once: its header (as int64 words) and its data block."""

    def __init__(self, bin_path: Path, json_path: Path):
        self.bin_path, self.json_path = bin_path, json_path
        self.header: torch.Tensor | None = None
        self.block: torch.Tensor | None = None

    def map(self, nbytes: int) -> torch.Tensor:
        """The data block of `nbytes`, the file made (0600) or reused at the right size."""
        size = HEADER_BYTES + nbytes
        fd = os.open(self.bin_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, 0)  # a slot of another size: its bytes are no copy of ours
                os.ftruncate(fd, size)
            os.pwrite(fd, _HEADER.pack(MAGIC, 0, 0, nbytes), 0)
        finally:
            os.close(fd)
        whole = torch.from_file(str(self.bin_path), shared=True, size=size, dtype=torch.uint8)
        self.header = whole[:HEADER_BYTES].view(torch.int64)
        self.block = whole[HEADER_BYTES:]
        self.block.fill_(0)  # fault every page in once, here, not in a timed copy
        return self.block

    def begin(self, gen: int) -> None:
        self.header[1] = gen

    def seal(self, gen: int, record: dict[str, Any]) -> None:
        tmp = self.json_path.with_name(f".tmp-{self.json_path.name}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
        fd = os.open(tmp, flags, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(record, separators=(",", ":")).encode())
        os.replace(tmp, self.json_path)
        self.header[2] = gen


@dataclass(frozen=True)
class CopyReport:
    step: int
    wait_seconds: float  # what the loop blocked for the copy
    copy_seconds: float  # the memcpy, beside training
    nbytes: int
    sealed: int | None  # the newest step sealed so far (its checksum follows its copy)
    check_seconds: float | None  # that seal's checksum, on the copy thread


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
        hooks: Hooks,
    ):
        self.directory, self.expect = directory, expect
        self.interval, self.local_world = interval, local_world
        self.model, self.optimizer = model, optimizer
        self.describe = describe  # (step, tokens, data, gather=False) -> meta without tensors
        self.hooks = hooks
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
        self.slots = [_Slot(*slot_paths(directory, expect.rank, s)) for s in range(SLOTS)]
        self.stagers = [ReusedStager(allocate=slot.map) for slot in self.slots]
        held, _ = find(directory, expect) if self.broken is None else ([], [])
        self.gen = 1 + max((h.gen for h in held), default=0)
        self.target = (held[0].slot + 1) % SLOTS if held else 0  # never the newest complete
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mem-ckpt")
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
        problem = self.broken or fit_problem(
            self.directory, need * SLOTS * self.local_world, self._reusable()
        )
        ok = torch.tensor(
            [0 if problem else 1], dtype=torch.int64, device=collectives.group_device()
        )
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if int(ok[0]):
            return None
        self.enabled = False
        self.off_reason = problem or "another node lacks the shared memory for both slots"
        self.close(remove=True)
        return self.off_reason

    def _reusable(self) -> int:
        """Bytes of slot files already there (this job's, on this node): reused, not added."""
        return sum(p.stat().st_size for p in self.directory.glob("rank-*/slot-*.bin"))

    # ---- saving ----------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return self.enabled and step % self.interval == 0

    @torch.no_grad()
    def save(self, step: int, tokens_seen: int, data: dict[str, Any]) -> None:
        """Hand the state as of the end of `step` to the copy thread; it must not change before
        `wait_copied` returns."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if not self.fit_checked:
            self.fit_checked = True
            if self.check_fit(state):
                return
        meta = self.describe(step, tokens_seen, data, gather=False)
        self._copied.clear()
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
        """The copy: once it is done the loop may change the live state again."""
        try:
            target, stager = self.slots[slot], self.stagers[slot]
            free.wait()  # an async durable save still writing this slot's older copy out
            if target.header is not None:
                target.begin(gen)  # from here the slot is torn until sealed
            snapshot = stager.stage(state)  # maps the slot on its first use
            target.begin(gen)
            self.hooks.in_memory_copy(meta["step"])
            return snapshot
        finally:
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
                "table": describe_tensors(copy.result(), target.block, digests=True),
                "saved_at": time.time(),
            }
            record = checked(record)
            check_seconds = time.perf_counter() - started
            target.seal(gen, record)
            self.check_seconds, self.sealed = check_seconds, meta["step"]
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
        self._copied.wait()
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
        return CopyReport(
            self._copy_step,
            waited,
            stager.copy_seconds,
            stager.nbytes,
            self.sealed,
            self.check_seconds,
        )

    def resumed_from(self, held: Held) -> None:
        """A load of `held` succeeded: the next copy goes into the other slot (the one resumed
        from stays whole meanwhile), with a generation newer than every slot's."""
        self.target = (held.slot + 1) % SLOTS
        self.gen = max(self.gen, held.gen + 1)

    def close(self, remove: bool) -> None:
        """Wait for a copy in flight; with `remove`, delete this rank's slots (and the job's
        directory when no one else holds it)."""
        if self._copy is not None:
            self._copied.wait()
            self._copy = None
        self._thread.shutdown(wait=True)
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


def describe_tensors(
    snapshot: dict[str, Any], block: torch.Tensor, digests: bool = False
) -> dict[str, Any]:
    """Where each of the staged state's entries lies in the slot: tensors by offset (with
    `digests`, and their bytes' checksum: `digest`), scalars and everything else by value
    (JSON)."""
    flat, _ = flatten_state_dict(snapshot)
    base = block.data_ptr()
    table: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            local = value._local_tensor if isinstance(value, DTensor) else value
            entry = {"dtype": str(local.dtype), "shape": list(local.shape)}
            if local.dim() == 0:
                entry["value"] = local.item()
            else:
                entry["offset"] = local.data_ptr() - base
                entry["nbytes"] = local.numel() * local.element_size()
                if digests:
                    entry["digest"] = digest(block[entry["offset"] :][: entry["nbytes"]])
            table[key] = entry
        else:
            table[key] = {"value": list(value) if isinstance(value, tuple) else value}
    return table


def read_into(path: Path, flat: dict[str, Any], table: dict[str, Any]) -> None:
    """Fill the live state's flattened entries from the slot file `path`, each tensor's bytes
    checked against its digest as they come in (a piece at a time: checked while still in the
    cache). SlotRefused where the slot's layout is not the live state's or a tensor's bytes
    fail their digest; the live state may then be partly overwritten, and must be loaded again
    (another slot, a durable checkpoint)."""
    if set(flat) != set(table):
        odd = sorted(set(flat) ^ set(table))[:3]
        raise SlotRefused(f"holds another state (entries {odd} differ)")
    for key, live in flat.items():  # the whole layout first: nothing is read into a mismatch
        entry = table[key]
        if not isinstance(live, torch.Tensor):
            continue
        local = live._local_tensor if isinstance(live, DTensor) else live
        if entry.get("dtype") != str(local.dtype) or entry.get("shape") != list(local.shape):
            raise SlotRefused(f"{key} is {entry.get('dtype')} {entry.get('shape')}")
        nbytes = local.numel() * local.element_size()
        if local.dim() == 0:
            if not isinstance(entry.get("value"), (bool, int, float)):
                raise SlotRefused(f"{key} has no value")
        elif entry.get("nbytes") != nbytes or not isinstance(entry.get("offset"), int):
            raise SlotRefused(f"{key}: {entry.get('nbytes')} bytes recorded, {nbytes} live")
        elif digest_problem(entry.get("digest"), nbytes):
            raise SlotRefused(f"{key}: {digest_problem(entry.get('digest'), nbytes)}")
    fd = open_slot_file(path)
    try:
        for key, live in flat.items():
            entry = table[key]
            if not isinstance(live, torch.Tensor):
                value = entry.get("value")
                flat[key] = tuple(value) if isinstance(live, tuple) else value
                continue
            local = live._local_tensor if isinstance(live, DTensor) else live
            if local.dim() == 0:
                local.fill_(entry["value"])
            else:
                _read_checked(fd, local, int(entry["offset"]), entry["digest"], key)
    finally:
        os.close(fd)


def _read_checked(fd: int, t: torch.Tensor, offset: int, digests: str, key: str) -> None:
    """Read a tensor's bytes from the slot's data at `offset` straight into it (a host copy
    first for a GPU or strided one), a piece at a time, each piece's page sums taken while it
    is in the cache; each CHECK_CHUNK's CRC against its digest."""
    direct = t.device.type == "cpu" and t.is_contiguous()
    host = t if direct else torch.empty(t.shape, dtype=t.dtype)
    data = host.detach().view(-1).view(torch.uint8)
    nbytes = data.numel()
    view = memoryview(data.numpy())
    for index, start in enumerate(range(0, nbytes, CHECK_CHUNK)):
        end = min(start + CHECK_CHUNK, nbytes)
        crc = 0
        for piece in range(start, end, READ_PIECE):
            stop = min(piece + READ_PIECE, end)
            done = piece
            while done < stop:
                n = os.preadv(fd, [view[done:stop]], HEADER_BYTES + offset + done)
                if n <= 0:
                    raise SlotRefused(f"{key}: the slot ends early")
                done += n
            crc = page_sums_crc(data[piece:stop], crc)
        if f"{crc:08x}" != digests[8 * index : 8 * index + 8]:
            where = f"bytes {start}-{end - 1}" if nbytes > CHECK_CHUNK else f"{nbytes} bytes"
            raise SlotRefused(f"{key}: its {where} fail their checksum")
    if not direct:
        t.copy_(host)

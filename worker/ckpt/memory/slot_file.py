"""A memory slot's files: the `.bin` (a header page, then the tensors' bytes, mapped once and
reused by every copy) and the `.json` record (replaced atomically, after the bytes); writing a
slot (`MappedSlot`), reading its header and record, and reading its bytes back into the live
state, checked as they come in.

Nothing here is unpickled: the record is JSON, the tensors raw bytes read into the live state.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from worker import lease
from worker.ckpt.memory.checksum import CHECK_CHUNK, digest_problem, page_sums_crc

FORMAT = "es-mem-2"  # es-mem-1: no checksums
MAGIC = b"ESMEMSL1"
HEADER_BYTES = 4096  # magic, generation before, generation after, data bytes; then padding
_HEADER = struct.Struct("<8sQQQ")
SLOTS = 2
READ_PIECE = 1 << 20  # read, then summed while in the cache
MAX_RECORD_BYTES = 256 << 20


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
    host: str | None  # None: any node (a partner copy, held for a rank of another node)

    def record(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.__dict__}


def rank_dir(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank}"


def slot_paths(directory: Path, rank: int, slot: int) -> tuple[Path, Path]:
    base = rank_dir(directory, rank)
    return base / f"slot-{slot}.bin", base / f"slot-{slot}.json"


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


def read_record(path: Path) -> bytes:
    fd = open_slot_file(path)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_RECORD_BYTES:
            raise SlotRefused(f"{path.name}: {size} bytes, more than a record's")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)


class MappedSlot:
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
        lease.guard()  # a fenced rank's copy is never sealed
        os.replace(tmp, self.json_path)
        self.header[2] = gen


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

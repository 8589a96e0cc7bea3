"""Fan-out: copy this rank's checkpoint files from the node-local stage dir to the durable dir.

Pure per-rank file I/O, no collectives and no torch, so it is safe on a background thread.
Each file lands under a temporary name, is fsynced, then renamed: a reader of the durable dir
sees either nothing or the whole file. The marker is not written here; the main thread does
that once every rank's copy is done.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from contracts import ckpt_files
from worker import lease

DCP_METADATA = ".metadata"
COPY_CHUNK = 16 << 20


def own_files(names: list[str], rank: int) -> list[str]:
    """What this rank copies: its own DCP shards, and on rank 0 also DCP's `.metadata`."""
    mine = re.compile(rf"^__{rank}_\d+\.distcp$")
    picked = sorted(n for n in names if mine.match(n))
    if rank == 0 and DCP_METADATA in names:
        picked.append(DCP_METADATA)
    return picked


@dataclass
class FanoutResult:
    """What the copy did: file -> crc32 (when asked for), bytes, seconds."""

    crcs: dict[str, int] = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0


def _copy_with_crc(src: Path, dst, chunk: int) -> int:
    crc = 0
    with src.open("rb") as f:
        while data := f.read(chunk):
            crc = zlib.crc32(data, crc)
            dst.write(data)
    return crc


def _kernel_copy(src_fd: int, dst_fd: int) -> None:
    """Copy inside the kernel (no bytes through Python); a reflink where the file system can."""
    size = os.fstat(src_fd).st_size
    copied = 0
    while copied < size:
        try:
            n = os.copy_file_range(src_fd, dst_fd, min(size - copied, 1 << 30))
        except OSError:  # e.g. across some file systems: fall back to sendfile
            n = os.sendfile(dst_fd, src_fd, copied, min(size - copied, 1 << 30))
        if n == 0:
            raise OSError(f"short copy: {copied} of {size} bytes")
        copied += n


def same_file_system(a: Path, b: Path) -> bool:
    return a.stat().st_dev == b.stat().st_dev


def copy_file_durably(
    src: Path,
    dst: Path,
    *,
    with_crc: bool,
    midway: Callable[[], None] = lambda: None,
) -> int | None:
    """src -> dst through `.tmp-<name>`, fsync, rename. Across file systems the bytes are
    copied: with `with_crc` through Python once, to checksum them; otherwise inside the kernel
    (copy_file_range / sendfile). On one file system, a hard link."""
    lease.guard()  # a fenced rank copies nothing more into the durable dir
    tmp = dst.with_name(f".tmp-{dst.name}")
    crc = None
    if same_file_system(src, dst.parent):
        # Same file system: a second name for the same bytes, no copy (the stage name goes
        # away with the stage dir). fsync makes the (unsynced) stage write durable.
        tmp.unlink(missing_ok=True)
        os.link(src, tmp)
        with tmp.open("rb+") as out:
            if with_crc:
                crc = ckpt_files.file_crc(tmp)
            midway()
            os.fsync(out.fileno())
        os.replace(tmp, dst)
        return crc
    with tmp.open("wb") as out:
        if with_crc:
            crc = _copy_with_crc(src, out, COPY_CHUNK)
        else:
            with src.open("rb") as f:
                _kernel_copy(f.fileno(), out.fileno())
        out.flush()
        midway()
        os.fsync(out.fileno())
    os.replace(tmp, dst)
    return crc


def fan_out(
    stage_step: Path,
    durable_step: Path,
    rank: int,
    *,
    with_crc: bool,
    midway: Callable[[], None] = lambda: None,
) -> FanoutResult:
    """Copy this rank's files of one checkpoint; raises on any failure (the caller turns that
    into a failed checkpoint on every rank)."""
    started = time.perf_counter()
    names = own_files([p.name for p in stage_step.iterdir()], rank)
    if not names:
        raise FileNotFoundError(f"no files of rank {rank} in {stage_step}")
    result = FanoutResult()
    for name in names:
        crc = copy_file_durably(
            stage_step / name, durable_step / name, with_crc=with_crc, midway=midway
        )
        if crc is not None:
            result.crcs[name] = crc
        result.nbytes += (durable_step / name).stat().st_size
    fd = os.open(durable_step, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    result.seconds = time.perf_counter() - started
    return result

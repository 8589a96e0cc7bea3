"""How checkpoint bytes meet the disk: DCP's planning and metadata with a raw file format.

DCP's own file writer serializes every tensor with `torch.save` and its reader calls
`torch.load` for each one and then copies the result into place; on load that bookkeeping, not
the disk, was the cost (a 300 MB state loaded at a fifth of the disk's read speed). Here a
tensor is stored as its bytes, and DCP's `.metadata` (which already holds every chunk's dtype
and shape) is all that is needed to read them back: straight into the destination tensor when
the stored chunk is the one wanted (the usual resume), through one host buffer when resharding
asks for part of it. Saving writes from the tensor's own memory and asks for write-back every
few MiB (`sync_file_range`, asynchronous), so the disk works while later tensors are still
being written and the final fsync finds little left.

The async path's stage copy is written with O_DIRECT from the staging buffers (`padded`): the
device reads the bytes straight from them, so no page-cache copy, dirty pages or write-back
compete with training for memory bandwidth and cores. Beside a 3 GB model's forward and
backward, writing its 1.4 GB shard through the page cache cost the step 1.7 s here; with
O_DIRECT, 0.3 s. Where the file system refuses O_DIRECT the same bytes go through the cache.

Each tensor's storage record carries the transform descriptor `RAW`; DCP's stock reader
refuses such a record rather than misreading it, and this reader still reads checkpoints that
DCP's stock writer made.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import math
import os
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from worker.ckpt import safe_load

RAW = "es-raw-bytes"  # transform descriptor: the record is the tensor's bytes, C order
WRITEBACK_EVERY = 32 << 20
DIRECT_ALIGN = 4096  # O_DIRECT: memory address, file offset and length are multiples of this
SHARD_SUFFIX = ".distcp"
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024
GAP_SKIP = 1 << 20  # bytes between two records (padding) read and dropped rather than sought
_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(None, use_errno=True)  # the process's own libc: no ldconfig run at import
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
_FALLOC_FL_KEEP_SIZE = 1
# fallocate(2), not glibc's posix_fallocate: that one writes zeros where it cannot reserve.
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def reserve(fd: int, nbytes: int) -> None:
    """Reserve a file's blocks in one piece before writing it (best effort, size unchanged).
    Two ranks writing their shards at once otherwise get interleaved extents, and a cold read
    of such a file was slower here (0.19-0.35 s against 0.15-0.19 s for 160 MB)."""
    if _fallocate is not None and nbytes > 0:
        _fallocate(fd, _FALLOC_FL_KEEP_SIZE, 0, nbytes)  # a refusal changes nothing


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing [offset, offset+nbytes) to disk; returns at once."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, shared with it (readable and writable)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def round_up(nbytes: int) -> int:
    return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN


def aligned_zeros(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 host tensor starting on a `DIRECT_ALIGN` boundary, its pages touched."""
    raw = torch.zeros(nbytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=pin)
    shift = -raw.data_ptr() % DIRECT_ALIGN
    return raw[shift : shift + nbytes]


def write_all(fd: int, data: memoryview, offset: int, eager: bool = True) -> None:
    """Write `data` at `offset`, with eager write-back of every finished `WRITEBACK_EVERY`."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done : done + WRITEBACK_EVERY], offset + done)
        if n <= 0:
            raise OSError(f"short write at byte {offset + done}")
        if eager:
            start_writeback(fd, offset + done, n)
        done += n


def read_into(fd: int, into: memoryview, offset: int, path: str) -> None:
    """Fill `into` from `offset`; a file that ends early is damage, named."""
    read_vectored(fd, [into], offset, path)


def read_vectored(fd: int, views: list[memoryview], offset: int, path: str) -> None:
    """Fill `views` in turn from the bytes starting at `offset`, in as few calls as the kernel
    allows (one `preadv` carries up to IOV_MAX buffers)."""
    pending = [v for v in views if len(v)]
    expected = offset + sum(len(v) for v in pending)
    at = offset
    while pending:
        n = os.preadv(fd, pending[:IOV_MAX], at)
        if n == 0:
            raise OSError(f"{path}: ends at byte {at}, expected {expected}")
        at += n
        while n:
            if n >= len(pending[0]):
                n -= len(pending.pop(0))
            else:
                pending[0] = pending[0][n:]
                n = 0


class RawWriter(FileSystemWriter):
    """DCP storage writer: one file per rank, tensors as raw bytes, fsync when the copy must
    be durable (the async path's stage copy need not be). With `padded` (tensor -> the
    `DIRECT_ALIGN`-padded bytes it owns, or None), the file is written with O_DIRECT: every
    record starts on an aligned offset, a tensor with padded bytes is written from its own
    memory and anything else through a small aligned bounce buffer."""

    def __init__(
        self,
        path,
        *,
        padded: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
        before_write: Callable[[Path], None] | None = None,
        **kw,
    ):
        super().__init__(path, **kw)
        self.padded = padded
        self.before_write = before_write  # test hooks: a full disk at this file
        self._direct = False

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{SHARD_SUFFIX}"
        path = Path(self.path) / name
        results = []
        if self.before_write is not None:
            self.before_write(path)
        fd = self._open(path)
        try:
            reserve(fd, _tensor_bytes(plan, padded=self._direct))
            offset = 0
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    view, descriptors, own = data.getbuffer(), None, None
                else:
                    tensor = data.detach().to("cpu").contiguous()
                    view, descriptors = byte_view(tensor), [RAW]
                    own = self.padded(tensor) if self._direct else None
                if self._direct:
                    out = byte_view(own) if own is not None else _bounce(view)
                    self._write_direct(fd, out, offset)
                    step = len(out)
                else:
                    write_all(fd, view, offset)
                    step = len(view)
                info = _StorageInfo(name, offset, len(view), transform_descriptors=descriptors)
                results.append(WriteResult(item.index, len(view), info))
                offset += step
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _open(self, path: Path) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self._direct = self.padded is not None
        if self._direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError:  # e.g. tmpfs
                self._direct = False
        return os.open(path, flags, 0o644)

    def _write_direct(self, fd: int, out: memoryview, offset: int) -> None:
        try:
            write_all(fd, out, offset, eager=False)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # Opened, but the file system will not write directly: the same bytes, cached.
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            write_all(fd, out, offset)


def _tensor_bytes(plan: SavePlan, *, padded: bool) -> int:
    """What a plan's tensor records will take in the file (byte records are small)."""
    total = 0
    for item in plan.items:
        data = item.tensor_data
        if data is not None:
            nbytes = math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
            total += round_up(nbytes) if padded else nbytes
    return total


def _bounce(view: memoryview) -> memoryview:
    """An aligned, padded copy of a small record (a scalar, DCP's byte records)."""
    out = byte_view(aligned_zeros(round_up(len(view))))
    out[: len(view)] = view
    return out


class RawReader(FileSystemReader):
    """DCP storage reader for `RawWriter`'s files (and, through DCP's own code, stock ones).
    Its metadata is read by `safe_load`, never by a plain unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = safe_load.load_metadata(Path(self.path) / ".metadata")
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kw):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kw)
        self._tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Raw tensor records and untransformed byte records are read here, file by file in
        offset order; anything else (DCP's stock tensor records) by DCP's own reader."""
        mine: dict[str, list[tuple[int, int, ReadItem, _StorageInfo]]] = defaultdict(list)
        stock = []
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            descriptors = info.transform_descriptors or ()
            raw = descriptors == [RAW] or descriptors == (RAW,)
            if raw or (req.type == LoadItemType.BYTE_IO and not descriptors):
                mine[info.relative_path].append((info.offset, id(req), req, info))
            else:
                stock.append(req)
        if stock:
            super().read_data(LoadPlan(stock, plan.storage_data, plan.planner_data), planner).wait()
        for relative, items in mine.items():
            path = str(Path(self.path) / relative)
            fd = os.open(path, os.O_RDONLY)
            try:
                # Read-ahead advice for the whole file, in one call (the kernel acts on it a
                # window at a time). Advice for each record instead made a 300 MB load twice as
                # slow here. With the run's own layout `read_ahead` has pulled the file already.
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                batch = _Batch(fd, path)
                for offset, _, req, info in sorted(items):
                    self._read_one(batch, offset, req, info, planner)
                batch.flush()
            finally:
                os.close(fd)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_one(
        self, batch: _Batch, offset: int, req: ReadItem, info: _StorageInfo, planner: LoadPlanner
    ) -> None:
        if req.type == LoadItemType.BYTE_IO:
            data = bytearray(info.length)
            batch.add(offset, memoryview(data), lambda: planner.load_bytes(req, io.BytesIO(data)))
            return
        md = self._tensors[req.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        dtype = md.properties.dtype
        target = planner.resolve_tensor(req).detach()
        # The whole stored chunk, into a destination laid out like it: straight into place.
        whole = not any(req.storage_offsets) and (
            math.prod(req.lengths) * dtype.itemsize == info.length
        )
        if whole and target.is_cpu and target.is_contiguous() and target.dtype == dtype:
            batch.add(offset, byte_view(target), lambda: planner.commit_tensor(req, target))
            return
        # Part of a stored chunk (resharding): through a buffer of the whole chunk, alone.
        batch.flush()
        chunk = _chunk_at(md, req.storage_index.offset)
        stored = torch.empty(chunk.sizes, dtype=dtype)
        read_into(batch.fd, byte_view(stored), offset, batch.path)
        for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
            stored = stored.narrow(dim, start, length)
        target.copy_(stored)
        planner.commit_tensor(req, target)


class _Batch:
    """Reads of one file gathered while they follow each other, then done in one vectored
    call: one large read instead of one per record (228 per rank for a 300 MB state), and
    the per-record work happens after it. Small gaps (O_DIRECT padding) are read into a
    throwaway buffer."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path
        self.start = self.end = 0
        self.views: list[memoryview] = []
        self.then: list[Callable[[], None]] = []
        self._gap = memoryview(bytearray(GAP_SKIP))

    def add(self, offset: int, view: memoryview, then: Callable[[], None]) -> None:
        if self.views and not (self.end <= offset <= self.end + GAP_SKIP):
            self.flush()
        if not self.views:
            self.start = self.end = offset
        if offset > self.end:
            self.views.append(self._gap[: offset - self.end])
        self.views.append(view)
        self.then.append(then)
        self.end = offset + len(view)

    def flush(self) -> None:
        if self.views:
            read_vectored(self.fd, self.views, self.start, self.path)
        for then in self.then:
            then()
        self.views, self.then = [], []


def _chunk_at(md: TensorStorageMetadata, offsets):
    for chunk in md.chunks:
        if list(chunk.offsets) == list(offsets):
            return chunk
    raise ValueError(f"no stored chunk at offsets {list(offsets)}")


def shard_name(rank: int) -> str:
    """The file `RawWriter` gives rank `rank`'s shards (DCP numbers the plans by rank)."""
    return f"__{rank}_0{SHARD_SUFFIX}"


PULL_CHUNK = 8 << 20
_pulling: dict[str, threading.Event] = {}  # file -> its read-ahead thread's stop flag


def read_ahead(path: Path) -> None:
    """Pull a whole file into the page cache on a thread, inside the kernel (`sendfile` to
    /dev/null: no copy to user space), while the caller does other work; its own reads then
    copy from the cache. (`posix_fadvise(WILLNEED)` reads only the first read-ahead window
    here.) A file already being pulled is left to that thread; `stop_read_ahead` ends it
    once the caller has read the file itself, so it takes no more CPU from training."""
    key = str(path)
    if key in _pulling:
        return
    stop = _pulling[key] = threading.Event()

    def pull() -> None:
        try:
            src = os.open(path, os.O_RDONLY)
        except OSError:
            _pulling.pop(key, None)
            return  # the load itself reports a missing file
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            offset = 0
            while not stop.is_set() and (n := os.sendfile(null, src, offset, PULL_CHUNK)):
                offset += n
        except OSError:
            pass
        finally:
            os.close(src)
            os.close(null)
            _pulling.pop(key, None)

    threading.Thread(target=pull, name="es-read-ahead", daemon=True).start()


def stop_read_ahead(path: Path) -> None:
    stop = _pulling.get(str(path))
    if stop is not None:
        stop.set()


def writer(directory: Path, *, durable: bool = True, padded=None, before_write=None) -> RawWriter:
    return RawWriter(directory, sync_files=durable, padded=padded, before_write=before_write)


def reader(directory: Path) -> RawReader:
    return RawReader(directory)

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

Each tensor's storage record carries the transform descriptor `RAW`; DCP's stock reader
refuses such a record rather than misreading it, and this reader still reads checkpoints that
DCP's stock writer made.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections import defaultdict
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

RAW = "es-raw-bytes"  # transform descriptor: the record is the tensor's bytes, C order
WRITEBACK_EVERY = 32 << 20
SHARD_SUFFIX = ".distcp"
_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing [offset, offset+nbytes) to disk; returns at once."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, shared with it (readable and writable)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """Write `data` at `offset`, with eager write-back of every finished `WRITEBACK_EVERY`."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done : done + WRITEBACK_EVERY], offset + done)
        if n <= 0:
            raise OSError(f"short write at byte {offset + done}")
        start_writeback(fd, offset + done, n)
        done += n


def read_into(fd: int, into: memoryview, offset: int, path: str) -> None:
    """Fill `into` from `offset`; a file that ends early is damage, named."""
    done = 0
    while done < len(into):
        n = os.preadv(fd, [into[done:]], offset + done)
        if n == 0:
            raise OSError(f"{path}: ends at byte {offset + done}, expected {offset + len(into)}")
        done += n


class RawWriter(FileSystemWriter):
    """DCP storage writer: one file per rank, tensors as raw bytes, fsync when the copy must
    be durable (the async path's stage copy need not be)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{SHARD_SUFFIX}"
        path = Path(self.path) / name
        results = []
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            for item in plan.items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    view, descriptors = data.getbuffer(), None
                else:
                    tensor = data.detach().to("cpu").contiguous()
                    view, descriptors = byte_view(tensor), [RAW]
                write_all(fd, view, offset)
                info = _StorageInfo(name, offset, len(view), transform_descriptors=descriptors)
                results.append(WriteResult(item.index, len(view), info))
                offset += len(view)
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


class RawReader(FileSystemReader):
    """DCP storage reader for `RawWriter`'s files (and, through DCP's own code, stock ones)."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kw):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kw)
        self._tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw = [r for r in plan.items if RAW in (self._info(r).transform_descriptors or ())]
        stock = [r for r in plan.items if RAW not in (self._info(r).transform_descriptors or ())]
        if stock:
            super().read_data(LoadPlan(stock), planner).wait()
        per_file: dict[str, list[ReadItem]] = defaultdict(list)
        for req in raw:
            per_file[self._info(req).relative_path].append(req)
        for relative, reqs in per_file.items():
            path = str(Path(self.path) / relative)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                for req in sorted(reqs, key=lambda r: self._info(r).offset):
                    self._read_tensor(fd, path, req, planner)
            finally:
                os.close(fd)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _info(self, req: ReadItem) -> _StorageInfo:
        return self.storage_data[req.storage_index]

    def _read_tensor(self, fd: int, path: str, req: ReadItem, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            raise ValueError(f"{path}: a byte record marked as a raw tensor")
        info = self._info(req)
        md = self._tensors[req.storage_index.fqn]
        assert isinstance(md, TensorStorageMetadata)
        chunk = _chunk_at(md, req.storage_index.offset)
        target = planner.resolve_tensor(req).detach()
        whole = list(req.lengths) == list(chunk.sizes)
        if (
            whole
            and target.is_cpu
            and target.is_contiguous()
            and target.dtype == md.properties.dtype
        ):
            read_into(fd, byte_view(target), info.offset, path)  # straight into place
        else:
            stored = torch.empty(chunk.sizes, dtype=md.properties.dtype)
            read_into(fd, byte_view(stored), info.offset, path)
            for dim, (start, length) in enumerate(
                zip(req.storage_offsets, req.lengths, strict=True)
            ):
                stored = stored.narrow(dim, start, length)
            target.copy_(stored)
        planner.commit_tensor(req, target)


def _chunk_at(md: TensorStorageMetadata, offsets):
    for chunk in md.chunks:
        if list(chunk.offsets) == list(offsets):
            return chunk
    raise ValueError(f"no stored chunk at offsets {list(offsets)}")


def writer(directory: Path, *, durable: bool = True) -> RawWriter:
    return RawWriter(directory, sync_files=durable)


def reader(directory: Path) -> RawReader:
    return RawReader(directory)

"""How checkpoint bytes meet the disk: DCP's file writer and reader with the page cache put to
work.

DCP writes each shard file through the page cache and fsyncs it at the end; the kernel starts
writing dirty pages back only past its dirty threshold (gigabytes on a big host), so the disk
idles while DCP serializes and then everything waits in the final fsync. Here a written file
asks for write-back every few MiB (`sync_file_range`, asynchronous), so the disk works while
the CPU is still serializing, and the fsync at the end finds little left. On load, the file is
announced with `POSIX_FADV_WILLNEED` so read-ahead covers it while DCP deserializes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

WRITEBACK_EVERY = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing [offset, offset+nbytes) to disk; returns at once."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class _EagerWriteback(io.RawIOBase):
    """A file opened for writing that starts write-back of every finished `WRITEBACK_EVERY`."""

    def __init__(self, raw: io.BufferedWriter):
        self._raw = raw
        self._flushed_to = 0  # write-back was asked for up to here

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        n = self._raw.write(data)
        pos = self._raw.tell()
        if pos - self._flushed_to >= WRITEBACK_EVERY:
            self._raw.flush()
            start_writeback(self._raw.fileno(), self._flushed_to, pos - self._flushed_to)
            self._flushed_to = pos
        return n

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        self._raw.flush()  # DCP fsyncs the descriptor: nothing may sit in Python's buffer
        return self._raw.fileno()

    def flush(self) -> None:
        self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes through self.flush while the file is open
            self._raw.close()


class EagerFileSystem(FileSystem):
    """DCP's local file system with eager write-back on write and read-ahead on read."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase]:
        path = Path(path)
        if "w" in mode:
            with path.open(mode) as raw:
                stream = _EagerWriteback(raw)
                try:
                    yield stream
                finally:
                    stream.close()
        else:
            with path.open(mode) as stream:
                os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
                os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                yield stream


def writer(directory: Path, *, durable: bool = True, threads: int = 1):
    """DCP's file writer as this project uses it: one file per rank and thread, eager
    write-back, fsync when the copy must be durable (the stage copy need not be)."""
    from torch.distributed.checkpoint import FileSystemWriter

    w = FileSystemWriter(directory, thread_count=threads, sync_files=durable)
    w.fs = EagerFileSystem()
    return w


def reader(directory: Path):
    from torch.distributed.checkpoint import FileSystemReader

    r = FileSystemReader(directory)
    r.fs = EagerFileSystem()
    return r


def skip_record_crc() -> None:
    """Serialize tensors without the zip format's per-record CRC-32: it costs a full pass over
    the bytes on the saving thread, and meta.json already records every file's size (and, with
    `--ckpt-verify crc`, a checksum that resume verifies). Loading does not need it."""
    import torch

    torch.serialization.set_crc32_options(False)

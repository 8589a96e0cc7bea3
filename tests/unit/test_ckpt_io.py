"""The raw checkpoint format (worker/ckpt/storage.py): real DCP save and load, one process."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from worker.ckpt import storage


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(33, 7, generator=g),
        "bf16": torch.randn(5, 9, generator=g).to(torch.bfloat16),
        "i64": torch.arange(11, dtype=torch.int64),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "strided": torch.randn(6, 4, generator=g).t(),  # not contiguous
        "empty": torch.empty(0, 3),
        "extra": {"lr": 0.1, "name": "adamw"},  # not a tensor: DCP's byte records
    }


def blank(like: dict) -> dict:
    out = {}
    for k, v in like.items():
        out[k] = torch.zeros_like(v) if isinstance(v, torch.Tensor) else dict.fromkeys(v)
    return out


def test_raw_round_trip_every_dtype_and_shape(tmp_path):
    saved = state()
    dcp.save(saved, storage_writer=storage.writer(tmp_path), no_dist=True)
    loaded = blank(saved)
    dcp.load(loaded, storage_reader=storage.reader(tmp_path), no_dist=True)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value


def test_tensors_are_stored_as_their_bytes(tmp_path):
    tensors = {k: v for k, v in state().items() if torch.is_tensor(v)}
    dcp.save(tensors, storage_writer=storage.writer(tmp_path), no_dist=True)
    shard = tmp_path / "__0_0.distcp"  # one file for the rank, no serialization around tensors
    assert shard.stat().st_size == sum(v.numel() * v.element_size() for v in tensors.values())


def test_loads_into_a_non_contiguous_destination(tmp_path):
    saved = {"w": torch.arange(24, dtype=torch.float32).reshape(4, 6)}
    dcp.save(saved, storage_writer=storage.writer(tmp_path), no_dist=True)
    into = {"w": torch.zeros(6, 4).t()}  # the same shape, transposed storage
    dcp.load(into, storage_reader=storage.reader(tmp_path), no_dist=True)
    assert torch.equal(into["w"], saved["w"])


def test_reads_checkpoints_of_dcp_stock_writer(tmp_path):
    saved = state()
    dcp.save(saved, storage_writer=dcp.FileSystemWriter(tmp_path), no_dist=True)
    loaded = blank(saved)
    dcp.load(loaded, storage_reader=storage.reader(tmp_path), no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in saved.items() if torch.is_tensor(v))


def test_a_short_file_is_named(tmp_path):
    saved = {"w": torch.randn(1000)}
    dcp.save(saved, storage_writer=storage.writer(tmp_path), no_dist=True)
    shard = tmp_path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointException) as failed:
        dcp.load({"w": torch.zeros(1000)}, storage_reader=storage.reader(tmp_path), no_dist=True)
    assert "__0_0.distcp: ends at byte 100, expected 4000" in str(failed.value.failures[0])


def staged_state():
    """A state staged the way the async path stages it: views of one aligned block."""
    from worker.ckpt.staging import ReusedStager

    stager = ReusedStager()
    tensors = {k: v for k, v in state().items() if torch.is_tensor(v)}
    return stager, stager.stage(tensors), tensors


def test_direct_write_from_the_staging_block(tmp_path):
    stager, staged, tensors = staged_state()
    writer = storage.writer(tmp_path, durable=False, padded=stager.padded)
    dcp.save(staged, storage_writer=writer, no_dist=True)
    meta = storage.reader(tmp_path).read_metadata()
    offsets = [info.offset for info in meta.storage_data.values()]
    assert all(off % storage.DIRECT_ALIGN == 0 for off in offsets)  # every record aligned
    loaded = blank(tensors)
    dcp.load(loaded, storage_reader=storage.reader(tmp_path), no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a tmpfs at /dev/shm")
def test_direct_write_falls_back_where_the_file_system_refuses_it():
    stager, staged, tensors = staged_state()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as where:  # tmpfs: no O_DIRECT
        writer = storage.writer(Path(where), durable=False, padded=stager.padded)
        dcp.save(staged, storage_writer=writer, no_dist=True)
        loaded = blank(tensors)
        dcp.load(loaded, storage_reader=storage.reader(Path(where)), no_dist=True)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_vectored_read_fills_more_buffers_than_one_call_takes(tmp_path):
    data = bytes(range(256)) * 40
    (tmp_path / "f").write_bytes(data)
    views = [memoryview(bytearray(n)) for n in [3, 0, 5] * (storage.IOV_MAX // 2 + 7)]
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        storage.read_vectored(fd, views, 17, "f")
        with pytest.raises(OSError, match="f: ends at byte 10240, expected 10250"):
            storage.read_vectored(fd, [memoryview(bytearray(20))], len(data) - 10, "f")
    finally:
        os.close(fd)
    got = b"".join(bytes(v) for v in views)
    assert got == data[17 : 17 + len(got)]

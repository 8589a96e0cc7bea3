"""Async checkpoints, the pure parts: the readiness decision, which files a rank copies, the
fan-out copy. The kills in each phase of a save, under real mpiexec, are in
e2e/test_async_ckpt_processes.py."""

from __future__ import annotations

import shutil
import tempfile
import zlib
from pathlib import Path

import pytest

from worker.ckpt.async_save import Readiness, default_stage_root, readiness
from worker.ckpt.fanout import fan_out, own_files


# ---- pure parts ------------------------------------------------------------------------------
def test_readiness_waits_for_every_rank_and_fails_as_one():
    assert readiness(1, 0, 2) is Readiness.PENDING
    assert readiness(1, 1, 3) is Readiness.PENDING  # a failure waits for the last copy to end
    assert readiness(2, 0, 2) is Readiness.READY
    assert readiness(1, 1, 2) is Readiness.FAILED


def test_each_rank_copies_only_its_own_files():
    names = ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__10_0.distcp", ".metadata"]
    assert own_files(names, 0) == ["__0_0.distcp", "__0_1.distcp", ".metadata"]
    assert own_files(names, 1) == ["__1_0.distcp"]


def a_parent(tmp_path):
    return default_stage_root(str(tmp_path), None).parent


def test_stage_root_is_per_job(tmp_path):
    assert default_stage_root(str(tmp_path), "job7-0123abcd").name == "es-ckpt-job7-0123abcd"
    # A job id of another form never becomes a path: one directory right under the temp dir.
    for odd in ("a/../../b", "..", "x" * 300):
        assert default_stage_root(str(tmp_path), odd).parent == a_parent(tmp_path)
        assert default_stage_root(str(tmp_path), odd).name.startswith("es-ckpt-")
    a, b = default_stage_root(str(tmp_path / "a"), None), default_stage_root(str(tmp_path), None)
    assert a != b and a.parent == b.parent


SHM = Path("/dev/shm")


@pytest.mark.parametrize("across", [False, True], ids=["link", "copy"])
@pytest.mark.parametrize("with_crc", [True, False])
def test_fan_out_copies_whole_files_with_checksums(tmp_path, with_crc, across):
    """On one file system the durable name is a link; across two, a kernel or Python copy."""
    if across and not (SHM.is_dir() and SHM.stat().st_dev != tmp_path.stat().st_dev):
        pytest.skip("no second file system at /dev/shm")
    stage_parent = Path(tempfile.mkdtemp(dir=SHM)) if across else tmp_path
    stage, durable = stage_parent / "stage", tmp_path / "durable"
    stage.mkdir()
    durable.mkdir()
    payload = bytes(range(256)) * 5000
    (stage / "__1_0.distcp").write_bytes(payload)
    (stage / "__0_0.distcp").write_bytes(b"not mine")
    try:
        result = fan_out(stage, durable, 1, with_crc=with_crc)
    finally:
        if across:
            shutil.rmtree(stage_parent)
    assert sorted(p.name for p in durable.iterdir()) == ["__1_0.distcp"]
    assert (durable / "__1_0.distcp").read_bytes() == payload
    assert result.nbytes == len(payload)
    assert result.crcs == ({"__1_0.distcp": zlib.crc32(payload)} if with_crc else {})


def test_fan_out_without_own_files_fails(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError):
        fan_out(tmp_path / "s", tmp_path / "d", 0, with_crc=False)

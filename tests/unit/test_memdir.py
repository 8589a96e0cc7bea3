"""The memory tier's directories: the start-of-job sweep and the job's own directory, with real
processes holding real flocks (`protocol.hold_mem_dir`), as the ranks will."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor import memdir
from supervisor import protocol as P
from tests.support import REPO

HOLDER = """
import sys, time
from supervisor import protocol
fd = protocol.hold_mem_dir(sys.argv[1])
open(sys.argv[2], "w").close()
time.sleep(120)
"""


def hold_in_a_process(path: Path, tmp_path: Path) -> subprocess.Popen:
    """A live process (a rank's stand-in) holding `path` shared until it is killed."""
    ready = tmp_path / f"{path.name}.ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(ready)], cwd=REPO, env={**os.environ}
    )
    deadline = time.monotonic() + 30
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the holder did not take {path} (exit {proc.poll()})")
        time.sleep(0.02)
    return proc


def test_the_sweep_removes_only_what_no_live_process_holds(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    live = root / "es-mem-live"
    proc = hold_in_a_process(live, tmp_path)
    try:
        never = root / "es-mem-never"  # a job's dir whose lock file was never made
        (never / "slot-0").mkdir(parents=True)
        (never / "slot-0" / "state").write_bytes(b"x" * 100)
        dead = root / "es-mem-dead"  # held once, by a process long gone
        fd = P.hold_mem_dir(dead)
        (dead / "rank-0.a").write_bytes(b"y")
        os.close(fd)
        other = root / "other-dir"
        other.mkdir()
        (root / "es-mem-a-file").write_text("not a directory")
        outside = tmp_path / "es-mem-outside"  # abandoned, but only linked from the root
        outside.mkdir()
        (outside / "keep").write_text("k")
        (root / "es-mem-link").symlink_to(outside, target_is_directory=True)

        removed = memdir.sweep_abandoned(root)

        assert sorted(removed) == [str(dead), str(never)]
        assert not dead.exists() and not never.exists()
        assert (live / P.LOCK_FILE).is_file()  # the live holder's dir stays
        assert other.is_dir() and (root / "es-mem-a-file").is_file()
        assert (root / "es-mem-link").is_symlink() and (outside / "keep").is_file()
        assert memdir.sweep_abandoned(root) == []  # nothing more to take while it lives

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert memdir.sweep_abandoned(root) == [str(live)]
        assert not live.exists()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_missing_root_is_nothing_to_sweep(tmp_path):
    assert memdir.sweep_abandoned(tmp_path / "nope") == []
    (tmp_path / "file").write_text("")
    assert memdir.sweep_abandoned(tmp_path / "file") == []


def test_only_this_user_s_es_mem_directories_are_candidates(tmp_path):
    me = os.getuid()
    d = os.lstat(tmp_path)
    f = os.lstat(REPO / "README.md")
    (tmp_path / "l").symlink_to(tmp_path)
    link = os.lstat(tmp_path / "l")

    def owned_by(st: os.stat_result, uid: int) -> os.stat_result:
        fields = list(st)
        fields[4] = uid  # st_uid
        return os.stat_result(fields)

    assert memdir.sweepable("es-mem-job-1", owned_by(d, me), me)
    assert not memdir.sweepable("es-mem-job-1", owned_by(d, me + 1), me)  # another user's
    assert not memdir.sweepable("es-mem-job-1", owned_by(f, me), me)  # a file
    assert not memdir.sweepable("es-mem-job-1", owned_by(link, me), me)  # a symlink
    assert not memdir.sweepable("esmem-job-1", owned_by(d, me), me)
    assert not memdir.sweepable("x-es-mem-job-1", owned_by(d, me), me)


def test_the_job_s_own_directory_is_held_then_removed(tmp_path):
    held = memdir.hold(tmp_path, "job-1")
    path = Path(held.path)
    assert path == tmp_path / "es-mem-job-1"
    assert path.is_dir() and (path.stat().st_mode & 0o777) == 0o700
    (path / "slot").write_bytes(b"z")
    assert memdir.sweep_abandoned(tmp_path) == []  # another job's sweep leaves it alone
    assert memdir.remove(held) is None
    assert not path.exists()
    with pytest.raises(OSError):
        os.fstat(held.fd)  # let go


def test_wanted_only_with_a_positive_interval():
    assert memdir.wanted({"mem_ckpt_interval": 1})
    for flags in ({}, {"mem_ckpt_interval": 0}, {"mem_ckpt_interval": True}, {"save_interval": 5}):
        assert not memdir.wanted(flags)


def test_root_follows_the_environment_the_ranks_get(monkeypatch, tmp_path):
    monkeypatch.delenv(P.ENV_MEM_ROOT, raising=False)
    assert memdir.root({}) == "/dev/shm"
    monkeypatch.setenv(P.ENV_MEM_ROOT, str(tmp_path))
    assert memdir.root({}) == str(tmp_path)
    assert memdir.root({P.ENV_MEM_ROOT: "/elsewhere"}) == "/elsewhere"  # [launch] env wins


def test_root_problem_names_what_cannot_hold_the_directory(tmp_path):
    assert memdir.root_problem(str(tmp_path)) is None
    assert memdir.root_problem(str(tmp_path / "a" / "b")) is None  # made when held
    (tmp_path / "f").write_text("")
    assert memdir.root_problem(str(tmp_path / "f" / "x")) == f"{tmp_path / 'f'} is not a directory"

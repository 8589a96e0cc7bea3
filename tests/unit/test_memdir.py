"""The memory tier's directories: the start-of-job sweep and the job's own directory, with real
processes holding real flocks (`locks.hold_mem_dir`), as the ranks will."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from contracts import env_names, locks, scratch
from supervisor.host import memdir
from tests.support import REPO

HOLDER = """
import sys, time
from contracts import locks
fd = locks.hold_mem_dir(sys.argv[1])
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
    live = root / "es-mem-live-0000aaaa"
    proc = hold_in_a_process(live, tmp_path)
    try:
        never = root / "es-mem-0123456789ab"  # a worker's own dir, its lock file never made
        (never / "slot-0").mkdir(parents=True)
        (never / "slot-0" / "state").write_bytes(b"x" * 100)
        dead = root / "es-mem-dead-0000dead"  # held once, by a process long gone
        fd = locks.hold_mem_dir(dead)
        (dead / "rank-0.a").write_bytes(b"y")
        os.close(fd)
        other = root / "other-dir"
        other.mkdir()
        (root / "es-mem-a-0000ffff").write_text("not a directory")
        outside = tmp_path / "es-mem-outside-0000eeee"  # abandoned, only linked from the root
        outside.mkdir()
        (outside / "keep").write_text("k")
        (root / "es-mem-link-0000cccc").symlink_to(outside, target_is_directory=True)

        removed = memdir.sweep_abandoned(root)

        assert sorted(removed) == [str(never), str(dead)]
        assert not dead.exists() and not never.exists()
        assert (live / locks.LOCK_FILE).is_file()  # the live holder's dir stays
        assert other.is_dir() and (root / "es-mem-a-0000ffff").is_file()
        assert (root / "es-mem-link-0000cccc").is_symlink() and (outside / "keep").is_file()
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

    assert memdir.sweepable("es-mem-job-1-0123abcd", owned_by(d, me), me)
    assert memdir.sweepable("es-mem-0123456789ab", owned_by(d, me), me)  # a worker's own
    assert not memdir.sweepable("es-mem-job-1-0123abcd", owned_by(d, me + 1), me)  # another's
    assert not memdir.sweepable("es-mem-job-1-0123abcd", owned_by(f, me), me)  # a file
    assert not memdir.sweepable("es-mem-job-1-0123abcd", owned_by(link, me), me)  # a symlink
    assert not memdir.sweepable("esmem-job-1-0123abcd", owned_by(d, me), me)
    assert not memdir.sweepable("x-es-mem-job-1-0123abcd", owned_by(d, me), me)


@pytest.mark.parametrize(
    "name",
    [
        "es-mem-a",  # the issue's: job "a/b" made es-mem-a/b-<hex>/, "a" held by no lock
        "es-mem-job-1",
        "es-mem-job-0123abc",  # 7 hex digits
        "es-mem-job-0123abcde",  # 9: the name would be "job-0"
        "es-mem-job-0123ABCD",
        "es-mem-0123456789a",
        "es-mem-0123456789abc",
        "es-mem--0123abcd",
        "es-mem-.x-0123abcd",
        "es-mem-a..b-0123abcd",
        "es-mem-" + "x" * 65 + "-0123abcd",
        "es-mem-job-0123abcd.bak",
        "es-mem-job-0123abcd\n",
        "es-mem-jöb-0123abcd",
        "es-mem-job 1-0123abcd",
    ],
)
def test_only_directories_of_exactly_the_memory_tier_s_form_are_candidates(tmp_path, name):
    d = os.lstat(tmp_path)
    assert not memdir.sweepable(name, d, d.st_uid)
    assert not scratch.MEM_DIR_NAME.fullmatch(name)
    assert memdir.sweepable("es-mem-" + "x" * 64 + "-0123abcd", d, d.st_uid)


def test_a_sweep_beside_directories_of_other_forms_leaves_them(tmp_path):
    """Issue 25 item 2: `a/b` running, its directory nested in `es-mem-a`; a sweep (job `a/c`
    starting) removed `es-mem-a` with it. Only the exact form is swept."""
    root = tmp_path / "shm"
    nested = root / "es-mem-a" / "b-0123abcd"  # the running job's (held by it)
    proc = hold_in_a_process(nested, tmp_path)
    try:
        others = [root / n for n in ("es-mem-job", "es-mem-x-123", "es-mem-a-0123abcd.old")]
        for d in others:
            (d / "rank-0").mkdir(parents=True)
            (d / "rank-0" / "slot-0.bin").write_bytes(b"s")
        dead = root / "es-mem-dead-0000dead"
        dead.mkdir()
        assert memdir.sweep_abandoned(root) == [str(dead)]
        assert (nested / locks.LOCK_FILE).is_file()
        assert all((d / "rank-0" / "slot-0.bin").is_file() for d in others)
    finally:
        proc.kill()
        proc.wait(timeout=30)


OPENER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)  # a slot held open, no lock taken
os.chdir(sys.argv[2])
open(sys.argv[3], "w").close()
time.sleep(120)
"""


def test_a_directory_a_live_process_uses_is_never_removed_whatever_its_lock_says(tmp_path):
    """Its lock file gone (or never made), yet a live process holds a file open in it, or works
    in it: held."""
    root = tmp_path / "shm"
    opened = root / "es-mem-open-0000000a"
    (opened / "rank-0").mkdir(parents=True)
    (opened / "rank-0" / "slot-0.bin").write_bytes(b"slot")
    cwd = root / "es-mem-cwd-0000000b"
    (cwd / "rank-1").mkdir(parents=True)
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", OPENER, str(opened / "rank-0" / "slot-0.bin"),
                             str(cwd / "rank-1"), str(ready)])  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the opener did not start"
            time.sleep(0.02)
        assert memdir.sweep_abandoned(root) == []
        assert (opened / "rank-0" / "slot-0.bin").is_file() and (cwd / "rank-1").is_dir()
        (root / "link-0000000c").symlink_to(opened)  # the same directory by another name
        linked = tmp_path / "via-link"
        linked.symlink_to(root)
        assert memdir.sweep_abandoned(linked) == []
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert sorted(memdir.sweep_abandoned(root)) == [str(cwd), str(opened)]


def test_held_under_is_by_whole_path_components():
    held = {"/shm/es-mem-a-0123abcd/rank-0/slot-0.bin", "/work"}
    assert memdir.held_under("/shm/es-mem-a-0123abcd", held)
    assert memdir.held_under("/work", held)
    assert not memdir.held_under("/shm/es-mem-a-0123abc", held)
    assert not memdir.held_under("/shm/es-mem-a", held)
    assert not memdir.held_under("/wor", held)


@pytest.mark.parametrize(
    "job_id",
    ["a/b-0123abcd", "../x-0123abcd", "..", ".", "", "x\0y", "/etc", "a" * 300, "job-1",
     "jöb-0123abcd", "a-0123abcd/../../etc"],
)  # fmt: skip
def test_a_path_escaping_job_id_still_names_one_directory_of_the_swept_form(tmp_path, job_id):
    path = scratch.mem_dir(tmp_path, job_id)
    assert os.path.dirname(path) == str(tmp_path)
    assert scratch.MEM_DIR_NAME.fullmatch(os.path.basename(path))
    assert scratch.mem_dir(tmp_path, job_id) == path  # the supervisor and the ranks agree
    held = memdir.hold(tmp_path, job_id)
    try:
        assert held.path == path and Path(path).is_dir()
        assert sorted(os.listdir(tmp_path)) == [os.path.basename(path)]
    finally:
        assert memdir.remove(held) is None
    assert os.listdir(tmp_path) == []


def test_a_job_id_of_the_form_names_its_directory_as_it_is(tmp_path):
    assert scratch.mem_dir(tmp_path, "train.v2_a-0123abcd") == str(
        tmp_path / "es-mem-train.v2_a-0123abcd"
    )
    assert scratch.mem_dir(tmp_path, "0123456789ab") == str(tmp_path / "es-mem-0123456789ab")


def test_the_job_s_own_directory_is_held_then_removed(tmp_path):
    held = memdir.hold(tmp_path, "job-1-0123abcd")
    path = Path(held.path)
    assert path == tmp_path / "es-mem-job-1-0123abcd"
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
    monkeypatch.delenv(env_names.ENV_MEM_ROOT, raising=False)
    assert memdir.root({}) == "/dev/shm"
    monkeypatch.setenv(env_names.ENV_MEM_ROOT, str(tmp_path))
    assert memdir.root({}) == str(tmp_path)
    assert memdir.root({env_names.ENV_MEM_ROOT: "/elsewhere"}) == "/elsewhere"  # [launch] env wins


def test_root_problem_names_what_cannot_hold_the_directory(tmp_path):
    assert memdir.root_problem(str(tmp_path)) is None
    assert memdir.root_problem(str(tmp_path / "a" / "b")) is None  # made when held
    (tmp_path / "f").write_text("")
    assert memdir.root_problem(str(tmp_path / "f" / "x")) == f"{tmp_path / 'f'} is not a directory"

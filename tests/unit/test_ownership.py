"""One job per run dir and per checkpoint dir: the lock, and a second job refused at once."""

from __future__ import annotations

import grp
import os
import time

import pytest

from contracts import env_names, locks
from supervisor.commands import cli
from supervisor.host import ownership
from supervisor.policy.access import access_for
from supervisor.settings.config import ConfigError
from tests.support import one_line_error
from worker.errors import UsageError
from worker.train import take_umask


def test_lock_names_its_holder_and_dies_with_it(tmp_path):
    fd = locks.lock_dir(tmp_path, {"job": "j-1", "host": "n7", "pid": 42})
    assert locks.lock_holder(tmp_path) == {"job": "j-1", "host": "n7", "pid": 42}
    with pytest.raises(locks.DirInUse, match=r"in use by another job \(job j-1, host n7, pid 42\)"):
        locks.lock_dir(tmp_path, {"job": "j-2"})
    os.close(fd)
    assert locks.lock_holder(tmp_path) is None  # released: the file's old words no longer count
    os.close(locks.lock_dir(tmp_path, {"job": "j-2"}))


def test_claim_takes_run_and_checkpoint_dirs(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    fds = ownership.claim(run, str(ckpt), "job-a", "a")
    try:
        with pytest.raises(ConfigError, match="run dir in use: job job-a"):
            ownership.claim(run, str(tmp_path / "other"), "job-b", "b")
        with pytest.raises(ConfigError, match="checkpoint dir in use: job job-a") as info:
            ownership.claim(tmp_path / "run-b", str(ckpt), "job-b", "b")
        assert f"(pid {os.getpid()} on " in str(info.value)
        assert locks.lock_holder(tmp_path / "run-b") is None  # a refused claim keeps nothing
    finally:
        for fd in fds:
            os.close(fd)


def test_an_unwritable_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="run dir cannot be written .*choose a writable"):
        ownership.claim(blocker / "run", None, "j", "j")


def test_a_second_supervisor_on_the_same_run_dir_exits_2_at_once(tmp_path, capsys):
    run = tmp_path / "run"
    config = tmp_path / "job.toml"
    config.write_text(f'[job]\nname = "twice"\nrun_dir = "{run}"\n[worker]\ntrain_iters = 5\n')
    fd = locks.lock_dir(
        run, {"job": "twice-0001", "host": "here", "pid": 4242, "since": time.time()}
    )
    try:
        started = time.monotonic()
        assert cli.main(["run", str(config)]) == 2
        assert time.monotonic() - started < 10
    finally:
        os.close(fd)
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"error: {run}: run dir in use: job twice-0001 (pid 4242 on here, since " in err
    assert not (run / "events.jsonl").exists() and not (run / "attempts").exists()


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o7777


def test_the_dirs_a_job_makes_are_its_users_alone_unless_shared(tmp_path):
    """Missing parents included; a directory that exists keeps its own mode."""
    os.chmod(tmp_path, 0o755)
    old = os.umask(0o022)  # a login node's usual umask: it must not decide
    try:
        ownership.make_dir(tmp_path / "runs" / "a", access_for(""))
        assert _mode(tmp_path / "runs") == _mode(tmp_path / "runs" / "a") == 0o700
        group = grp.getgrgid(os.getegid()).gr_name
        ownership.make_dir(tmp_path / "shared" / "b", access_for(group))
        for made in (tmp_path / "shared", tmp_path / "shared" / "b"):
            assert _mode(made) == 0o2750 and os.stat(made).st_gid == os.getegid()
        ownership.make_dir(tmp_path, access_for(""))
        assert _mode(tmp_path) == 0o755  # there already: not ours to change
    finally:
        os.umask(old)


def test_a_group_to_share_with_must_exist_and_be_yours(tmp_path, capsys):
    assert ownership.group_problem(grp.getgrgid(os.getegid()).gr_name) is None
    assert ownership.group_problem("no-such-group-es") == (
        "no group 'no-such-group-es' on this host; name a group you are in (`id -Gn` lists them)"
    )
    config = tmp_path / "job.toml"
    config.write_text(
        f'[job]\nrun_dir = "{tmp_path}/run"\nshare_with_group = "no-such-group-es"\n'
        "[worker]\ntrain_iters = 5\n"
    )
    line = one_line_error(capsys, ["validate", str(config)])
    assert "job.share_with_group: no group 'no-such-group-es'" in line


def test_the_ranks_take_the_supervisors_umask():
    assert access_for("").umask_text == "077" and access_for("g").umask_text == "027"
    assert env_names.umask_of({}) is None and env_names.umask_of({"ES_UMASK": "027"}) == 0o027
    old = os.umask(0o022)
    try:
        take_umask({"ES_UMASK": "077"})
        assert os.umask(0o022) == 0o077
        with pytest.raises(UsageError, match="ES_UMASK='rw' is not a umask"):
            take_umask({"ES_UMASK": "rw"})
    finally:
        os.umask(old)

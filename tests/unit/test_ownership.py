"""One job per run dir and per checkpoint dir: the lock, and a second job refused at once."""

from __future__ import annotations

import os
import time

import pytest

from contracts import locks
from supervisor.commands import cli
from supervisor.host import ownership
from supervisor.settings.config import ConfigError


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

"""One job per run dir and per checkpoint dir: the lock, and a second job refused at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor import cli, ownership
from supervisor import protocol as P
from supervisor.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_lock_names_its_holder_and_dies_with_it(tmp_path):
    fd = P.lock_dir(tmp_path, {"job": "j-1", "host": "n7", "pid": 42})
    assert P.lock_holder(tmp_path) == {"job": "j-1", "host": "n7", "pid": 42}
    with pytest.raises(P.DirInUse, match=r"in use by another job \(job j-1, host n7, pid 42\)"):
        P.lock_dir(tmp_path, {"job": "j-2"})
    os.close(fd)
    assert P.lock_holder(tmp_path) is None  # released: the file's old words no longer count
    os.close(P.lock_dir(tmp_path, {"job": "j-2"}))


def test_a_killed_holder_releases_the_lock(tmp_path):
    code = (
        "import sys, time; from supervisor import protocol as P; "
        f"P.lock_dir({str(tmp_path)!r}, {{'job': 'child'}}); print('locked', flush=True); "
        "time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "locked"
        assert P.lock_holder(tmp_path) == {"job": "child"}
    finally:
        child.kill()
        child.wait(timeout=10)
    assert P.lock_holder(tmp_path) is None


def test_claim_takes_run_and_checkpoint_dirs(tmp_path):
    run, ckpt = tmp_path / "run", tmp_path / "ckpt"
    fds = ownership.claim(run, str(ckpt), "job-a", "a")
    try:
        with pytest.raises(ConfigError, match="run dir in use: job job-a"):
            ownership.claim(run, str(tmp_path / "other"), "job-b", "b")
        with pytest.raises(ConfigError, match="checkpoint dir in use: job job-a") as info:
            ownership.claim(tmp_path / "run-b", str(ckpt), "job-b", "b")
        assert f"(pid {os.getpid()} on " in str(info.value)
        assert P.lock_holder(tmp_path / "run-b") is None  # a refused claim keeps nothing
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
    fd = P.lock_dir(run, {"job": "twice-0001", "host": "here", "pid": 4242, "since": time.time()})
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


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), **extra)  # fmt: skip
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY_WORKER = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--n-kv-heads", "1",
               "--vocab-size", "64", "--seq-len", "16", "--device", "cpu"]  # fmt: skip


def test_a_worker_by_hand_on_a_supervised_checkpoint_dir_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    fd = P.lock_dir(ckpt, {"job": "sup-1234", "host": "n1", "pid": 77})
    try:
        cmd = [sys.executable, "-m", "worker.train", *TINY_WORKER, "--train-iters", "2",
               "--ckpt-dir", str(ckpt), "--outdir", str(tmp_path / "out")]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO, env=worker_env(), capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == (
            f"error: --ckpt-dir {ckpt} is in use by job sup-1234 (pid 77 on n1); wait for it "
            "to end or choose another --ckpt-dir"
        )
        # The supervisor's own ranks (its job id) go ahead.
        mine = subprocess.run(cmd, cwd=REPO, env=worker_env(ES_JOB_ID="sup-1234"),
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert mine.returncode == 0, mine.stderr
    finally:
        os.close(fd)


def test_a_worker_run_by_hand_holds_its_checkpoint_dir(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "worker.train", *TINY_WORKER, "--train-iters", "100000",
           "--ckpt-dir", str(ckpt), "--outdir", str(tmp_path / "out")]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=worker_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while P.lock_holder(ckpt) is None and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        holder = P.lock_holder(ckpt)
        assert holder is not None and holder["pid"] == proc.pid
        with pytest.raises(ConfigError, match="checkpoint dir in use: job worker.train-"):
            ownership.claim(tmp_path / "run", str(ckpt), "sup-2", "sup")
    finally:
        proc.kill()
        proc.wait(timeout=30)

"""Locks held by a real process: a killed holder, and a worker run by hand on a checkpoint dir."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from contracts import locks
from supervisor.host import ownership
from supervisor.settings.config import ConfigError
from tests.support import REPO


def test_a_killed_holder_releases_the_lock(tmp_path):
    code = (
        "import sys, time; from contracts import locks; "
        f"locks.lock_dir({str(tmp_path)!r}, {{'job': 'child'}}); print('locked', flush=True); "
        "time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "locked"
        assert locks.lock_holder(tmp_path) == {"job": "child"}
    finally:
        child.kill()
        child.wait(timeout=10)
    assert locks.lock_holder(tmp_path) is None


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
    fd = locks.lock_dir(ckpt, {"job": "sup-1234", "host": "n1", "pid": 77})
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
        while locks.lock_holder(ckpt) is None and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        holder = locks.lock_holder(ckpt)
        assert holder is not None and holder["pid"] == proc.pid
        with pytest.raises(ConfigError, match="checkpoint dir in use: job worker.train-"):
            ownership.claim(tmp_path / "run", str(ckpt), "sup-2", "sup")
    finally:
        proc.kill()
        proc.wait(timeout=30)

"""The per-node clean a multi-node job runs on each of its nodes (`supervisor.host.node_clean`):
what it removes and what it leaves, on this host's directories."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from contracts import locks
from supervisor.host import node_clean
from supervisor.run import node_cleaner
from tests.support import REPO

JOB = "bed-0123abcd"  # 12 characters, as a worker's own tag (12 hex digits) is
OTHER = "train-89abcdef"


def test_which_stage_dirs_a_sweep_takes():
    names = [f"es-ckpt-{JOB}", f"es-ckpt-{OTHER}", "es-ckpt-0123456789ab", "es-ckpt-..", "x"]
    assert node_clean.stale_stage_dirs("/t", names, set()) == [
        f"/t/es-ckpt-{JOB}",
        f"/t/es-ckpt-{OTHER}",
    ]  # fmt: skip  (a worker's own 12-digit hash and what is not of the form: never)
    assert node_clean.stale_stage_dirs("/t", names, {JOB}) == [f"/t/es-ckpt-{OTHER}"]


def test_the_program_removes_the_job_s_scratch_and_leaves_what_a_live_job_holds(tmp_path):
    mem, stage = tmp_path / "shm", tmp_path / "tmp"
    ours, theirs = mem / f"es-mem-{JOB}", mem / f"es-mem-{OTHER}"
    for d in (ours / "rank-0", theirs, stage / f"es-ckpt-{JOB}" / "step-4", stage / "keep"):
        d.mkdir(parents=True)
    (ours / "rank-0" / "slot-0.bin").write_bytes(b"x" * 4096)
    held = locks.hold_mem_dir(theirs)  # a live job of the same user on the node
    try:
        env = {**os.environ, "ES_MEM_ROOT": str(mem), "TMPDIR": str(stage), "PYTHONPATH": str(REPO)}
        out = subprocess.run(
            [sys.executable, "-m", "supervisor.host.node_clean", "--job", JOB],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(held)
    assert out.returncode == 0, out.stderr
    (report,) = node_cleaner.reports(out.stdout.splitlines()).values()
    assert sorted(report["removed"]) == [str(ours), str(stage / f"es-ckpt-{JOB}")]
    assert theirs.is_dir() and (stage / "keep").is_dir() and not ours.exists()
    assert report["left"] == [] and json.loads(out.stdout.split(node_clean.MARK)[1]) == report


def test_a_remote_rank_0_s_port_is_drawn_below_its_ephemeral_range():
    from supervisor.launch import hosts

    assert hosts.listen_range("32768\t60999\n") == (20000, 32768)
    assert hosts.listen_range("10000 60999") == (5904, 10000)
    assert hosts.listen_range(None) == hosts.listen_range("1500 2000") == (20000, 32768)
    for _ in range(50):
        assert 20000 <= hosts.rendezvous_port("n-elsewhere.invalid") < 32768
    assert hosts.rendezvous_port("localhost") >= 1024  # free here, checked here

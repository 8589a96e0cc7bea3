"""Who may read a job's files (issue 40, item 10), end to end: the real supervisor and the real
worker (tiny model, 2 ranks under mpiexec) started under a login node's usual umask `022`, with
the checkpoint dir outside the run dir. Nothing either wrote (events, logs, metrics, the report,
checkpoint shards and markers, the locks) may be open to other users; with `share_with_group`,
readable by that group and still closed to others.
"""

from __future__ import annotations

import grp
import os
from pathlib import Path

import pytest

from tests.support import TINY_JOB_WORKER, events, finish_supervisor, job_toml, start_supervisor

pytestmark = pytest.mark.slow


def run_job(tmp_path: Path, group: str) -> None:
    (tmp_path / "elsewhere").mkdir(mode=0o755)  # a shared place; the ckpt dir in it is the job's
    worker = {**TINY_JOB_WORKER, "train_iters": 4, "save_interval": 2,
              "ckpt_dir": str(tmp_path / "elsewhere" / "ckpt")}  # fmt: skip
    config = job_toml(tmp_path, {
        "job": {"name": "mine", "run_dir": str(tmp_path / "run"), "share_with_group": group},
        "launch": {"launcher": "mpiexec", "ranks_per_node": 2},
        "launch.env": {"OMP_NUM_THREADS": "1"},
        "worker": worker,
        "restart": {"standby": False},
    })  # fmt: skip
    proc = start_supervisor(config, preexec_fn=lambda: os.umask(0o022))
    rc, out = finish_supervisor(proc, 180)
    assert rc == 0, out[-4000:]
    assert [e["step"] for e in events(tmp_path / "run") if e["event"] == "ckpt_complete"]


def everything(root: Path) -> list[Path]:
    return [root, *root.rglob("*")]


def test_a_jobs_files_are_its_users_alone(tmp_path):
    run_job(tmp_path, "")
    run, ckpt = tmp_path / "run", tmp_path / "elsewhere" / "ckpt"
    assert (run / "report.md").is_file() and list(ckpt.glob("step-*/.complete"))
    assert (run / "attempts" / "000" / "metrics-0.jsonl").is_file()  # written by rank 0
    # The ranks here inherit the supervisor's umask; those on other hosts are told it.
    assert "ES_UMASK=077" in (run / "attempts" / "000" / "command.txt").read_text()
    open_to_others = {
        str(p): oct(p.stat().st_mode & 0o777)
        for p in everything(run) + everything(ckpt)
        if p.stat().st_mode & 0o077
    }
    assert not open_to_others
    assert (run.stat().st_mode & 0o777) == (ckpt.stat().st_mode & 0o777) == 0o700


def test_a_job_shared_with_a_group_is_readable_by_it_alone(tmp_path):
    gid = os.getegid()
    run_job(tmp_path, grp.getgrgid(gid).gr_name)
    run, ckpt = tmp_path / "run", tmp_path / "elsewhere" / "ckpt"
    assert (run.stat().st_mode & 0o7777) == (ckpt.stat().st_mode & 0o7777) == 0o2750
    for path in everything(run) + everything(ckpt):
        mode = path.stat().st_mode
        assert not mode & 0o027, (path, oct(mode))  # the group never writes, others nothing
        assert mode & 0o040 and path.stat().st_gid == gid, (path, oct(mode))
        if path.is_dir():
            assert mode & 0o2010 == 0o2010, (path, oct(mode))  # entered, and setgid below

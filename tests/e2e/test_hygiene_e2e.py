"""End to end: after an attempt is killed (again and again), nothing of the job is left on the
node (issue 17, node hygiene): no MPI shared memory in /dev/shm, no launcher file in the temp
dir, no async stage dir; the memory tier's directory is kept on purpose and removed at the end.

Other tests may run beside these and make and leave entries of their own, so a before/after
count of /dev/shm would not tell whose they are: a watcher thread instead notes every file under
/dev/shm and the temp dirs that the job's processes map or hold open while they run (from
/proc/<pid>/maps and /proc/<pid>/fd, taken apart from whatever the job does to remove them), and
the test then finds none of them left, nor the job's own named directories.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil
import pytest

from contracts import scratch
from tests.support import (
    REPO,
    TINY_JOB_WORKER,
    events,
    finish_supervisor,
    job_toml,
    mpiexec,
    rank_env,
    start_supervisor,
)

JOB_TIMEOUT = 300
WATCH_EVERY_S = 0.05
WATCHED_ROOTS = ("/dev/shm/", "/tmp/", tempfile.gettempdir().rstrip("/") + "/")

WORKER = {
    **TINY_JOB_WORKER,
    "train_iters": 26,  # kills at 12 and 24, the hang at 18: four attempts
    "save_interval": 5,
    "async_ckpt": True,
    "mem_ckpt_interval": 2,
}

pytestmark = pytest.mark.slow


def node_paths(pid: int) -> set[str]:
    """Files under /dev/shm or a temp dir that process `pid` maps or holds open now."""
    found: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except OSError:
        maps = ""
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6:
            found.add(parts[5].removesuffix(" (deleted)"))
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}").removesuffix(" (deleted)"))
        except OSError:
            continue
    return {p for p in found if p.startswith(WATCHED_ROOTS)}


class Watcher(threading.Thread):
    """Notes what the descendants of `root` map or hold under the watched roots until stopped."""

    def __init__(self, root: int):
        super().__init__(daemon=True)
        self.root = root
        self.seen: set[str] = set()
        self.pids: set[int] = set()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(WATCH_EVERY_S):
            try:
                procs = psutil.Process(self.root).children(recursive=True)
            except psutil.Error:
                continue
            for proc in procs:
                self.pids.add(proc.pid)
                self.seen |= node_paths(proc.pid)

    def stop(self) -> set[str]:
        self.done.set()
        self.join(timeout=10)
        return self.seen


def write_config(
    tmp_path: Path, faults: list[dict], max_restarts: int = 12, template: bool = True
) -> Path:
    restart = {"max_restarts": max_restarts, "teardown_grace_s": 1.0, "backoff_s": [0],
               "max_same_resume": 4, "standby": False, "template": template}  # fmt: skip
    return job_toml(tmp_path, {
        "job": {"name": "hyg", "run_dir": str(tmp_path / "run")},
        "launch": {"launcher": "mpiexec", "ranks_per_node": 2},
        "launch.env": {"OMP_NUM_THREADS": "1"},
        "worker": WORKER,
        "restart": restart,
        # 5 s: on a loaded 2-core host a starting rank's beats can pause for 3 s (its imports
        # hold the interpreter); each such false hang costs an attempt (seen in a clean-clone run).
        "heartbeat": {"interval_s": 0.25, "timeout_s": 5.0},
        "heartbeat.progress": {"init": 120, "load": 120, "train": 8, "save": 120},
    }, faults)  # fmt: skip


def run_watched(config: Path) -> tuple[int, str, set[str]]:
    proc = start_supervisor(config, "--quiet")
    watcher = Watcher(proc.pid)
    watcher.start()
    try:
        rc, out = finish_supervisor(proc, JOB_TIMEOUT)
    finally:
        seen = watcher.stop()
    return rc, out, seen


def left_of(seen: set[str]) -> list[str]:
    """What of the job's files is still on the node (a directory counts by its top entry)."""
    return sorted(p for p in seen if os.path.lexists(p))


def job_dirs(job_id: str) -> list[Path]:
    """The job's own named scratch: the async stage dir and the memory tier's directory."""
    roots = {Path(tempfile.gettempdir()), Path(scratch.mem_root(os.environ))}
    return [r / f"{prefix}{job_id}" for r in roots for prefix in ("es-ckpt-", scratch.MEM_PREFIX)]


def mine(paths: set[str], tmp_path: Path) -> set[str]:
    """The node's files, not the test's own run dir nor the checkout and its interpreter (which
    may lie in a temp dir too: a CI clone under /tmp maps its venv's binaries and libraries)."""
    kept = (str(tmp_path), str(REPO) + "/", sys.prefix + "/", sys.base_prefix + "/")
    return {p for p in paths if not p.startswith(kept)}


@pytest.mark.parametrize("template", [True, False], ids=["forked", "cold"])
def test_killed_and_torn_down_attempts_leave_nothing_of_the_job(tmp_path, template):
    faults = [
        {"name": "kill", "every_steps": 12, "action": "kill"},  # SIGKILL of every rank
        {"name": "hang", "at_step": 18, "action": "hang", "target": "rank:1"},  # SIGSTOP:
        # the teardown's grace passes and it SIGKILLs the attempt (ranks, proxy and mpiexec)
    ]
    rc, out, seen = run_watched(write_config(tmp_path, faults, template=template))
    assert rc == 0, out[-4000:]
    evs = events(tmp_path / "run")
    job = next(e["job"] for e in evs if e["event"] == "start")
    fired = [e for e in evs if e["event"] == "fault"]
    assert sum(f["name"] == "kill" for f in fired) >= 2 and any(f["name"] == "hang" for f in fired)
    ends = [e["detected_by"] for e in evs if e["event"] == "attempt_end"]
    assert "hang" in ends and ends.count("exit") >= 3  # two kills at least, and the last: done
    teardowns = [e for e in evs if e["event"] == "teardown_done"]
    assert any(e["killed"] for e in teardowns)  # the hang's attempt was SIGKILLed

    seen = mine(seen, tmp_path)
    # What the job made on the node while it ran (the watcher saw it, the test is not empty):
    # MPICH's segments and Hydra's topology files (cold ranks only: ranks forked from a template
    # start no MPI), the memory tier's slots (mapped as long as a rank lives; the stage dir's
    # files are open for some milliseconds a save, too short for the watcher to be sure to see:
    # its removal is the stage_removed event checked below).
    assert any(p.startswith("/dev/shm/mpich_shm_") for p in seen) != template, sorted(seen)
    assert any("/hydra_hwloc_xmlfile_" in p for p in seen) != template, sorted(seen)
    assert any(f"/es-mem-{job}/" in p for p in seen), sorted(seen)
    assert left_of(seen) == []
    assert [str(d) for d in job_dirs(job) if d.exists()] == []
    # Removed where they arose, not by the end-of-job sweep of what nothing holds.
    swept = {
        p for e in evs if e["event"] == "node_sweep" and e["when"] == "end" for p in e["paths"]
    }
    assert not swept & seen, sorted(swept & seen)
    assert [e["path"] for e in evs if e["event"] == "stage_removed"] == [
        str(Path(tempfile.gettempdir()) / f"es-ckpt-{job}")
    ]


BY_HAND = """
import os, signal
from mpi4py import MPI  # MPI_Init: the node's segment is made and mapped
from worker import dist
names = dist.mpi_shm_paths(open("/proc/self/maps").read())
line = " ".join(["segments", *[f"{n}:{int(os.path.exists(n))}" for n in names]]) + "\\n"
os.write(1, line.encode())  # one write: the two ranks' lines share the launcher's output
dist.mpi_world()
dist.wait_until_read(1, 5.0)  # the launcher has our line before the kill tears the job down
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_ranks_killed_under_a_plain_mpiexec_leave_no_mpi_segment():
    proc = subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, "-c", BY_HAND],
        env={**rank_env(), "PYTHONPATH": str(REPO)}, cwd=REPO,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0  # the ranks were killed
    found = [ln.split()[1:] for ln in proc.stdout.splitlines() if "segments" in ln]
    assert len(found) == 2, proc.stdout + proc.stderr
    # One segment for the node, which each rank mapped and found there after MPI_Init ...
    assert {tuple(items) for items in found} == {(found[0][0],)}, found
    name, _, existed = found[0][0].rpartition(":")
    assert name.startswith("/dev/shm/mpich_shm_") and existed == "1"
    assert not os.path.exists(name)  # ... and none once they were killed


STOPPABLE = """
import signal, time
from mpi4py import MPI  # MPI_Init: Hydra's proxy writes its topology file for the ranks
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as a rank stuck in a step: it does not end
print("ready", flush=True)
time.sleep(120)
"""


def test_a_torn_down_hydra_attempt_leaves_no_topology_file(tmp_path):
    from supervisor.launch.plan import LaunchPlan, ProcSpec
    from supervisor.launch.processes import Launched

    argv = [mpiexec(), "-n", "2", sys.executable, "-c", STOPPABLE]
    plan = LaunchPlan("hydra", [ProcSpec(argv, rank_env())], 2, ["localhost"])
    out = tmp_path / "output.log"

    async def main():
        launched = await Launched.start(plan, out)
        for _ in range(600):  # bounded: 60 s for both ranks to be past MPI_Init
            if out.exists() and out.read_text().count("ready") == 2:
                break
            await asyncio.sleep(0.1)
        launched.refresh()
        procs = psutil.Process(launched.pids[0]).children(recursive=True)
        files = set().union(*(node_paths(p.pid) for p in procs))
        ranks = [p for p in procs if not p.children()]
        ranks[0].send_signal(signal.SIGSTOP)  # keeps the whole attempt alive past the grace
        result = await launched.teardown(0.5)
        return files, result

    files, result = asyncio.run(main())
    xml = [p for p in files if "/hydra_hwloc_xmlfile_" in p]
    assert xml, files
    assert result.survivors == [] and result.killed >= 3  # mpiexec, its proxy, the ranks
    assert [p for p in xml if os.path.exists(p)] == []

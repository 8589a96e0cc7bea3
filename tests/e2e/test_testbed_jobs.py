"""Supervised jobs on real hosts (the test bed, `testbed/`): each node its own hostname, address,
/dev/shm and node-local scratch; real Hydra reaches them over its ssh launcher (`testbed/ssh`).

- 3 hosts x 1 rank, the supervisor on this machine (a head node): a kill of every rank at a step,
  the warm relaunch resumes from the memory tier, every loss the uninterrupted run's; the ranks
  beat from the hosts' own addresses (the heartbeat port open to those alone); after the job
  nothing of it is left on any host: no process, no entry in any host's /dev/shm, no stage dir.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import testbed
from tests.e2e.test_nodes_e2e import last_losses, of
from tests.support import (
    TINY_JOB_WORKER,
    events,
    run_supervisor,
    toml_table,
    worker_flags,
)
from tests.testbed_support import bed_fixture, bed_module_fixture  # noqa: F401 (fixtures)

TESTBED_HOSTS = 3
JOB_TIMEOUT = 300
WORKER = {**TINY_JOB_WORKER, "train_iters": 24, "save_interval": 8, "mem_ckpt_interval": 1,
          "async_ckpt": True}  # fmt: skip
PLAIN = {k: v for k, v in WORKER.items() if k not in ("save_interval", "mem_ckpt_interval",
                                                      "async_ckpt")}  # fmt: skip


def bed_config(tmp_path: Path, bed: testbed.Bed, nodes: list[str], faults: list[dict],
               restart: dict | None = None) -> Path:  # fmt: skip
    """A job on the bed's hosts `nodes`, one rank each, through Hydra's ssh launcher."""
    text = toml_table("[job]", {"name": "bed", "run_dir": str(tmp_path / "run")})
    text += toml_table("[launch]", {
        "launcher": "mpiexec", "flavor": "hydra", "nodes": nodes, "ranks_per_node": 1,
        "args": bed.launcher_args(),
    })  # fmt: skip
    # the async stage dir in each host's own scratch (`<TMPDIR>/es-ckpt-<job>`: /tmp is shared)
    text += toml_table("[launch.env]", {"OMP_NUM_THREADS": "1", "TMPDIR": str(testbed.SCRATCH)})
    text += toml_table("[worker]", WORKER)
    text += toml_table("[restart]", {"backoff_s": [0], **(restart or {})})
    text += toml_table("[heartbeat]", {"interval_s": 0.25, "timeout_s": 5.0})
    for fault in faults:
        text += toml_table("[[faults]]", fault)
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def left_on_hosts(bed: testbed.Bed, job: str) -> dict[str, dict]:
    """Per host: the job's processes (by their ES_JOB_ID), /dev/shm's entries, the stage dirs."""
    probe = (
        "import json, os\n"
        "def env(p):\n"
        "    try: return open(f'/proc/{p}/environ', 'rb').read()\n"
        "    except OSError: return b''\n"
        f"mine = [p for p in os.listdir('/proc') if p.isdigit() and b'ES_JOB_ID={job}' in env(p)]\n"
        f"tmp = [n for n in os.listdir('{testbed.SCRATCH}') if n.startswith('es-ckpt-')]\n"
        "print(json.dumps({'procs': mine, 'shm': os.listdir('/dev/shm'), 'stage': tmp}))\n"
    )
    out = {}
    for host in bed.hosts:
        got = bed.exec(host, [sys.executable, "-c", probe], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
        assert got.returncode == 0, got.stderr
        out[host] = json.loads(got.stdout)
    return out


def test_a_job_on_three_hosts_resumes_from_memory_bit_exact_and_leaves_nothing(
    bed, tmp_path, reference
):
    want = reference(3, *worker_flags({**PLAIN, "train_iters": 24}))
    kill = {"name": "kill-all", "at_step": 13, "action": "kill"}
    config = bed_config(tmp_path, bed, bed.hosts, [kill])
    rc, out = run_supervisor(config, JOB_TIMEOUT)
    assert rc == 0, out[-6000:]
    run = tmp_path / "run"
    evs = events(run)
    job = of(evs, "start")[0]["job"]
    # the ranks ran on the hosts (and beat from their addresses: the job would have hung else)
    assert of(evs, "launch")[0]["nodes"] == bed.hosts, of(evs, "launch")
    ends = [e["outcome"] for e in of(evs, "attempt_end")]
    assert ends == ["failure", "success"], (ends, out[-4000:])
    (relaunch,) = of(evs, "relaunch")
    assert relaunch["mode"] == "warm", relaunch  # the standby, forked on the hosts
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == relaunch["attempt"]]
    assert resumed and resumed[0]["source"] == "memory", (resumed, relaunch)
    assert resumed[0]["step"] == 13  # nothing lost
    assert last_losses(run) == want  # bit for bit, every step
    # nothing of the job on any host
    cleaned = of(evs, "node_clean")
    assert [e["when"] for e in cleaned] == ["start", "end"] and not cleaned[-1]["silent"], cleaned
    assert sorted(set(cleaned[-1]["paths"])) == [
        f"/dev/shm/es-mem-{job}",
        f"{testbed.SCRATCH}/es-ckpt-{job}",
    ]  # fmt: skip  (each host's own: removed there, three times)
    assert cleaned[-1]["count"] == 6
    left = left_on_hosts(bed, job)
    for host, seen in left.items():
        assert seen["procs"] == [], (host, seen)
        assert [n for n in seen["shm"] if job in n or n.startswith("mpich")] == [], (host, seen)
        assert seen["stage"] == [], (host, seen)

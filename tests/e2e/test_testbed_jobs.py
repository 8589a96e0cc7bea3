"""Supervised jobs on real hosts (the test bed, `testbed/`): each node its own hostname, address,
/dev/shm and node-local scratch; real Hydra reaches them over its ssh launcher (`testbed/ssh`).

- The supervisor on host n0, SIGKILLed: nothing of its job lives on, what it kept in the
  hosts' /dev/shm and scratch is removed by the next job's start on every host.
- A host killed mid-job (every process at once, its /dev/shm gone): found by its silence,
  checked out, its rank resumed on the spare from its partner's copy through prepared ranks.
- A host that keeps failing swapped for the spare; a straggler's host replaced by it; with no
  spare, the job shrinks onto the hosts left; a host whose scratch cannot be written refused by
  the pre-launch check, on the host.
- 3 hosts x 1 rank, the supervisor on this machine (a head node): a kill of every rank at a step,
  the warm relaunch resumes from the memory tier, every loss the uninterrupted run's; the ranks
  beat from the hosts' own addresses (the heartbeat port open to those alone); after the job
  nothing of it is left on any host: no process, no entry in any host's /dev/shm, no stage dir.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import testbed
from tests.e2e.test_nodes_e2e import last_losses, of
from tests.support import (
    REPO,
    TINY_JOB_WORKER,
    events,
    finish_supervisor,
    read_metrics,
    run_supervisor,
    start_supervisor,
    supervisor_env,
    toml_table,
    worker_flags,
)
from tests.testbed_support import bed_fixture, bed_module_fixture  # noqa: F401 (fixtures)

TESTBED_HOSTS = 4
JOB_TIMEOUT = 300
WORKER = {**TINY_JOB_WORKER, "train_iters": 24, "save_interval": 8, "mem_ckpt_interval": 1,
          "async_ckpt": True}  # fmt: skip
# 1.5 s a step until the kill at step 13: the standby (forked on each host from its template) is
# ready well before it on 2 busy cores; the warm attempt runs at full speed (the fault fires once).
PACE = {"name": "pace", "at_step": 1, "action": "slow", "target": "all", "delay_s": 1.5,
        "duration_s": 600}  # fmt: skip
# Steps of ~0.3 s, not ~0.085: a job of 60 steps then outlasts its standby's and prepared
# ranks' start (4.3 s from the first step, seen in CI: the kill came after the last step).
STEP_PACE = {**PACE, "delay_s": 0.2}
PLAIN = {k: v for k, v in WORKER.items() if k not in ("save_interval", "mem_ckpt_interval",
                                                      "async_ckpt")}  # fmt: skip


def bed_config(tmp_path: Path, bed: testbed.Bed, nodes: list[str], faults: list[dict],
               restart: dict | None = None, worker: dict | None = None,
               spares: int = 0) -> Path:  # fmt: skip
    """A job on the bed's hosts `nodes`, one rank each, through Hydra's ssh launcher."""
    launch = {"launcher": "mpiexec", "flavor": "hydra", "nodes": nodes, "args": bed.launcher_args()}
    return write_job(tmp_path, "bed", launch, faults, restart, worker, spares)


def write_job(tmp_path: Path, name: str, launch: dict, faults: list[dict],
              restart: dict | None = None, worker: dict | None = None,
              spares: int = 0) -> Path:  # fmt: skip
    """The job file of a job on the bed, one rank per host, its launch `launch`."""
    text = toml_table("[job]", {"name": name, "run_dir": str(tmp_path / "run")})
    text += toml_table("[launch]", {**launch, "ranks_per_node": 1, "spares": spares})
    # the async stage dir in each host's own scratch (`<TMPDIR>/es-ckpt-<job>`: /tmp is shared)
    text += toml_table("[launch.env]", {"OMP_NUM_THREADS": "1", "TMPDIR": str(testbed.SCRATCH)})
    text += toml_table("[worker]", {**WORKER, **(worker or {})})
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
    config = bed_config(tmp_path, bed, bed.hosts[:3], [PACE, kill])
    rc, out = run_supervisor(config, JOB_TIMEOUT)
    assert rc == 0, out[-6000:]
    run = tmp_path / "run"
    evs = events(run)
    job = of(evs, "start")[0]["job"]
    # the ranks ran on the hosts (and beat from their addresses: the job would have hung else)
    assert of(evs, "launch")[0]["nodes"] == bed.hosts[:3], of(evs, "launch")
    ends = [e["outcome"] for e in of(evs, "attempt_end")]
    assert ends == ["failure", "success"], (ends, out[-4000:])
    (fault,) = [e for e in of(evs, "fault") if e["name"] == "kill-all"]
    ready = of(evs, "standby_ready")
    assert ready and ready[0]["mono"] < fault["mono"], "the standby was not ready by the kill"
    (relaunch,) = of(evs, "relaunch")
    assert relaunch["mode"] == "warm", relaunch  # the standby, forked on the hosts
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == relaunch["attempt"]]
    assert resumed and resumed[0]["source"] == "memory", (resumed, relaunch)
    assert resumed[0]["step"] >= 12, resumed  # at most the copy in flight at the kill
    assert last_losses(run) == want  # bit for bit, every step
    # nothing of the job on any host
    cleaned = of(evs, "node_clean")
    assert [e["when"] for e in cleaned] == ["start", "end"] and not cleaned[-1]["silent"], cleaned
    own = [p for p in cleaned[-1]["paths"] if job in p]
    mine = [f"/dev/shm/es-mem-{job}", f"{testbed.SCRATCH}/es-ckpt-{job}"]
    assert sorted(set(own)) == mine and len(own) == 6, cleaned[-1]  # each host's own, 3 times
    # /tmp is the machine's, shared by the hosts: a Hydra or MPICH file an earlier test's killed
    # proxy left there (older than the sweep's minimum age) is swept too, and rightly
    strays = [p for p in cleaned[-1]["paths"] if job not in p]
    assert all(p.startswith(("/tmp/hydra_hwloc_xmlfile_", "/tmp/mpich_")) for p in strays), strays
    left = left_on_hosts(bed, job)
    for host, seen in left.items():
        assert seen["procs"] == [], (host, seen)
        assert [n for n in seen["shm"] if job in n or n.startswith("mpich")] == [], (host, seen)
        assert seen["stage"] == [], (host, seen)


def wait_until(what, timeout: float, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    return what()


@pytest.mark.slow
def test_a_supervisor_killed_on_n0_leaves_what_the_next_job_removes_on_every_host(bed, tmp_path):
    """The supervisor on host n0 (as on a PBS mother-superior node, which runs ranks too),
    SIGKILLed mid-job: its ranks and templates on every host end with it, their memory and stage
    dirs stay; the next job, from this machine, removes them at its start on every host."""
    first = tmp_path / "first"
    first.mkdir()
    config = bed_config(first, bed, bed.hosts[:3], [], worker={"train_iters": 100000})
    proc = bed.popen("n0", [sys.executable, "-m", "supervisor", "run", str(config), "--quiet"],
                     cwd=str(REPO), env=supervisor_env(), stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        metrics = first / "run" / "attempts" / "000" / "metrics-0.jsonl"
        assert wait_until(lambda: metrics.exists() and len(read_metrics(metrics)) >= 6, 120)
        job = of(events(first / "run"), "start")[0]["job"]
        before = left_on_hosts(bed, job)
        assert all(f"es-mem-{job}" in before[h]["shm"] for h in bed.hosts[:3]), before
        killed = bed.exec("n0", ["pkill", "-KILL", "-f", f"supervisor run {config}"], timeout=30)
        assert killed.returncode == 0
        # every process of the job, on every host, ends with it: within the lease (10 s) + 5 s
        assert wait_until(lambda: all(not s["procs"] for s in left_on_hosts(bed, job).values()),
                          15), left_on_hosts(bed, job)  # fmt: skip
    finally:
        proc.kill()
        proc.wait(timeout=30)
    kept = left_on_hosts(bed, job)
    assert all(f"es-mem-{job}" in kept[h]["shm"] for h in bed.hosts[:3]), kept  # left behind

    second = tmp_path / "second"
    second.mkdir()
    rc, out = run_supervisor(bed_config(second, bed, bed.hosts[:3], [], worker={"train_iters": 4}),
                             JOB_TIMEOUT)  # fmt: skip
    assert rc == 0, out[-4000:]
    evs = events(second / "run")
    start = next(e for e in of(evs, "node_clean") if e["when"] == "start")
    assert f"/dev/shm/es-mem-{job}" in start["paths"] and not start["silent"], start
    again = of(evs, "start")[0]["job"]
    for host, seen in left_on_hosts(bed, job).items():
        assert not [n for n in seen["shm"] if job in n or again in n], (host, seen)
        assert seen["stage"] == [] and seen["procs"] == [], (host, seen)


@pytest.mark.slow
def test_a_host_killed_is_resumed_on_the_spare_from_its_partner(bed, tmp_path, reference):
    """4 hosts (3 + 1 spare), 1 rank each, standby on, a memory copy every step, durable every
    20: n1 killed (`testbed kill`: every process at once, its /dev/shm gone, unreachable). The
    spare takes its place, its rank resumes from its partner's copy (or from the durable tier
    when the kill came right after a durable save, as new as the copies): at most a step lost,
    bit-exact."""
    want = reference(3, *worker_flags({**PLAIN, "train_iters": 60}))
    hosts = bed.hosts  # n0..n3: n3 the spare
    worker = {"train_iters": 60, "save_interval": 20, "async_ckpt": False}
    config = bed_config(tmp_path, bed, hosts, [STEP_PACE], restart={"exclude_after": 2},
                        worker=worker, spares=1)  # fmt: skip
    proc = start_supervisor(config)
    run = tmp_path / "run"
    metrics = run / "attempts" / "000" / "metrics-0.jsonl"
    ready = lambda: any(e["event"] == "prepared_ready" for e in events(run))  # noqa: E731
    assert wait_until(lambda: metrics.exists() and len(read_metrics(metrics)) >= 25 and ready(),
                      120), events(run)[-5:]  # fmt: skip
    bed.kill("n1")
    rc, out = finish_supervisor(proc, JOB_TIMEOUT)
    bed.heal("n1")
    assert rc == 0, out[-6000:]
    evs = events(run)
    (relaunch,) = of(evs, "relaunch")
    launches = of(evs, "launch")
    assert launches[-1]["nodes"] == ["n0", "n3", "n2"], (launches, relaunch)
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == relaunch["attempt"]]
    assert resumed, out[-4000:]
    lost = max(r["step"] for r in read_metrics(metrics)) - resumed[0]["step"]
    assert lost <= 1, (lost, resumed)
    # from the partner's copy; from the durable tier only when its newest checkpoint is as new
    # (killed right after the save of step 20 or 40: memory is used only when it is newer)
    source, step = resumed[0]["source"], resumed[0]["step"]
    assert source == "partner" or (source == "durable" and step % 20 == 0 and lost == 0), (
        resumed,
        out[-4000:],
    )
    assert last_losses(run) == want  # bit for bit, every step


KILL_NODE_1 = {"name": "kill-node1", "at_step": [6, 14], "after_checkpoint": True,
               "action": "kill", "target": "node:1"}  # fmt: skip
NODES_WORKER = {"train_iters": 24, "save_interval": 4, "mem_ckpt_interval": 0, "async_ckpt": False}


@pytest.mark.slow
def test_a_host_that_keeps_failing_is_swapped_for_the_spare(bed, tmp_path, reference):
    want = reference(3, *worker_flags({**PLAIN, "train_iters": 24}))
    config = bed_config(tmp_path, bed, bed.hosts, [KILL_NODE_1], restart={"standby": False},
                        worker=NODES_WORKER, spares=1)  # fmt: skip
    rc, out = run_supervisor(config, JOB_TIMEOUT)
    assert rc == 0, out[-4000:]
    run = tmp_path / "run"
    evs = events(run)
    ends = [e for e in of(evs, "attempt_end") if e["outcome"] == "failure"]
    assert [e["node"] for e in ends] == ["n1", "n1"], ends
    (swapped,) = of(evs, "node_swapped")
    assert (swapped["out"], swapped["into"]) == ("n1", "n3")
    launches = [e["nodes"] for e in of(evs, "launch")]
    assert launches == [["n0", "n1", "n2"]] * 2 + [["n0", "n3", "n2"]], launches
    assert last_losses(run) == want  # bit for bit, every step


@pytest.mark.slow
def test_a_straggler_host_is_replaced_by_the_spare(bed, tmp_path, reference):
    """Rank 2 on n2 made slow (half a step more, every step): the `straggler` event names it and
    its host; the ranks stop at the next durable save and the spare n3 takes n2's place."""
    from tests.e2e.test_stragglers_e2e import SLOW

    want = reference(3, *worker_flags({**PLAIN, "train_iters": 24}))
    config = bed_config(tmp_path, bed, bed.hosts, [SLOW], restart={"standby": False},
                        worker=NODES_WORKER, spares=1)  # fmt: skip
    with config.open("a") as f:
        f.write('\n[stragglers]\naction = "replace"\n')
    rc, out = run_supervisor(config, JOB_TIMEOUT)
    assert rc == 0, out[-4000:]
    run = tmp_path / "run"
    evs = events(run)
    found = of(evs, "straggler")
    assert found and (found[0]["ranks"], found[0]["node"]) == ([2], "n2"), found or out[-3000:]
    (swapped,) = of(evs, "node_swapped")
    assert (swapped["out"], swapped["into"]) == ("n2", "n3")
    launches = [e["nodes"] for e in of(evs, "launch")]
    assert launches == [["n0", "n1", "n2"], ["n0", "n1", "n3"]], launches
    assert last_losses(run) == want  # bit for bit, every step


@pytest.mark.slow
def test_without_a_spare_the_job_shrinks_onto_the_hosts_left(bed, tmp_path):
    restart = {"shrink": True, "min_nodes": 2, "exclude_after": 1, "standby": False}
    once = {**KILL_NODE_1, "at_step": [6]}
    config = bed_config(tmp_path, bed, bed.hosts[:3], [once], restart=restart,
                        worker=NODES_WORKER)  # fmt: skip
    rc, out = run_supervisor(config, JOB_TIMEOUT)
    assert rc == 0, out[-4000:]
    run = tmp_path / "run"
    evs = events(run)
    (shrink,) = of(evs, "shrink")
    assert shrink["nodes"] == ["n0", "n2"] and shrink["world"] == [3, 2]
    last = of(evs, "launch")[-1]
    assert (last["nodes"], last["world"]) == (["n0", "n2"], 2)
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == last["attempt"]]
    assert resumed and resumed[0]["step"] >= 4 and resumed[0]["source"] == "durable"
    assert sorted(last_losses(run)) == list(range(1, 25))


@pytest.mark.slow
def test_a_host_whose_scratch_cannot_be_written_never_runs_a_rank(bed, tmp_path):
    """n2's node-local scratch (the async stage dir's root there) read-only: the pre-launch
    check on n2 itself refuses it, and the spare takes its place before any attempt."""
    ro = bed.exec("n2", ["mount", "-o", "remount,ro", str(testbed.SCRATCH)], timeout=30)
    assert ro.returncode == 0, ro.stderr
    try:
        config = bed_config(tmp_path, bed, bed.hosts, [], restart={"standby": False},
                            worker={"train_iters": 4}, spares=1)  # fmt: skip
        rc, out = run_supervisor(config, JOB_TIMEOUT)
    finally:
        bed.exec("n2", ["mount", "-o", "remount,rw", str(testbed.SCRATCH)], timeout=30)
    assert rc == 0, out[-4000:]
    evs = events(tmp_path / "run")
    (check,) = of(evs, "node_check")
    assert check["reported"] == 4 and list(check["failed"]) == ["n2"], check
    assert str(testbed.SCRATCH) in check["failed"]["n2"]
    assert [e["nodes"] for e in of(evs, "launch")] == [["n0", "n1", "n3"]]

"""A node cut off on the test bed (`partition`): found, fenced, replaced, and nothing it writes
after its fence is used.

4 hosts of 1 rank (n0..n2 and the spare n3), standby on, a memory copy every step, durable every
20. At step 30 the `partition` fault cuts n1's link for 30 s; its rank lives on and, once no
lease renewal has reached it for 7 s, keeps writing complete checkpoints far ahead into the
durable dir (`ES_INJECT` `write_when_cut_s`: a split-brain rank that keeps saving) until its
lease stops it. The supervisor finds n1 silent, fences the attempt, finds the host out of reach
(`node_unreachable`), resumes on the spare from the partner copies (at most a step lost), and
every late checkpoint is refused and removed: the run is the uninterrupted run, bit for bit. After
the heal no process of the fenced attempt is left on n1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from contracts import ckpt_files, fences
from tests.e2e.test_nodes_e2e import last_losses, of
from tests.e2e.test_testbed_jobs import PLAIN, bed_config, left_on_hosts, wait_until
from tests.support import (
    REPO,
    events,
    finish_supervisor,
    read_metrics,
    start_supervisor,
    supervisor_env,
    worker_flags,
)
from tests.testbed_support import bed_fixture, bed_module_fixture  # noqa: F401 (fixtures)
from worker.late_writes import AHEAD

pytestmark = pytest.mark.slow

TESTBED_HOSTS = 4
JOB_TIMEOUT = 300
ITERS = 150
CUT_AT = 30
LEASE_S = 10.0  # [heartbeat] lease_s "auto" with interval_s 0.25
TIMEOUT_S = 5.0  # bed_config's [heartbeat] timeout_s
PACE = {
    "name": "pace",
    "at_step": 1,
    "action": "slow",
    "target": "all",
    "delay_s": 0.25,
    "duration_s": 600,
}  # fmt: skip  (the prepared ranks ready by the cut on 2 busy cores)
CUT = {"name": "cut-n1", "at_step": CUT_AT, "action": "partition", "target": "node:1",
       "duration_s": 30}  # fmt: skip


def test_a_node_cut_off_is_fenced_replaced_and_nothing_it_writes_is_used(bed, tmp_path, reference):
    want = reference(3, *worker_flags({**PLAIN, "train_iters": ITERS}))
    worker = {"train_iters": ITERS, "save_interval": 20, "async_ckpt": False}
    config = bed_config(tmp_path, bed, bed.hosts, [PACE, CUT], restart={"exclude_after": 2},
                        worker=worker, spares=1)  # fmt: skip
    text = config.read_text().replace(
        "[launch.env]\n", '[launch.env]\nES_INJECT = "rank=1,write_when_cut_s=7"\n', 1
    )
    config.write_text(text)
    proc = start_supervisor(config)
    run = tmp_path / "run"
    rc, out = finish_supervisor(proc, JOB_TIMEOUT)
    assert rc == 0, out[-6000:]
    evs = events(run)
    job = of(evs, "start")[0]["job"]
    (cut,) = [e for e in of(evs, "fault") if e["name"] == "cut-n1"]
    assert cut["action"] == "partition" and cut["node"] == "n1", cut
    # found: silent within the heartbeat timeout (+1 s), out of reach, excluded
    (hang,) = [e for e in of(evs, "hang") if e["attempt"] == cut["attempt"]]
    assert hang["detected_mono"] - cut["mono"] <= TIMEOUT_S + 1.0, (hang, cut)
    (unreachable,) = of(evs, "node_unreachable")
    assert unreachable["node"] == "n1", unreachable
    assert [e["node"] for e in of(evs, "node_excluded")] == ["n1"]
    # the spare in its place, resumed from the partners' copies: at most one step lost
    (relaunch,) = of(evs, "relaunch")
    assert of(evs, "launch")[-1]["nodes"] == ["n0", "n3", "n2"], (of(evs, "launch"), relaunch)
    resumed = [e for e in of(evs, "resumed") if e["attempt"] == relaunch["attempt"]]
    assert resumed and resumed[0]["source"] in ("partner", "memory"), (resumed, out[-4000:])
    first = run / "attempts" / f"{cut['attempt']:03d}" / "metrics-0.jsonl"
    lost = max(r["step"] for r in read_metrics(first)) - resumed[0]["step"]
    assert lost <= 1, (lost, resumed)
    # every step of every attempt is the uninterrupted run's: no late checkpoint was resumed
    assert all(e["step"] < AHEAD for e in of(evs, "resumed")), of(evs, "resumed")
    assert last_losses(run) == want
    # the cut-off rank did write after the fence; none of it is left or was used
    ckpt = run / "ckpt"
    fence = fences.read_all(ckpt)[(job, cut["attempt"])]
    assert fence.why == "hang", fence
    swept = [s for e in of(evs, "fenced_writes_removed") for s in e["steps"]]
    refused = out.count("removing checkpoint step-1000")  # at a resume, by rank 0
    assert swept or refused, out[-6000:]  # it wrote, and was refused
    assert all(s >= AHEAD for s in swept), swept  # nothing else
    # A late write that lands after the job's last sweep (the cut rank's lease not yet run out
    # when the job ended: seen in CI) stays on disk, but a resume refuses it by its fence
    # record; a dir without its marker is never resumed at all.
    fenced = fences.read_all(ckpt)
    left = [f for f in ckpt_files.scan(ckpt) if f.step >= AHEAD]
    kept = [f.step for f in left if f.complete and fences.late_step(f.path, fenced) is None]
    assert kept == [], kept
    # after the heal: nothing of the fenced attempt (nor of the job) on n1
    healed = of(evs, "partition_healed")
    assert healed and healed[0]["node"] == "n1" and "error" not in healed[0], healed
    assert healed[0]["mono"] - cut["mono"] >= 30 or of(evs, "supervisor_exit"), healed
    assert wait_until(lambda: not left_on_hosts(bed, job)["n1"]["procs"], LEASE_S + 5), (
        left_on_hosts(bed, job)["n1"]
    )


def test_a_supervisor_cut_off_and_killed_leaves_no_rank_beyond_the_lease(bed, tmp_path):
    """The supervisor on n0 (as on a PBS mother-superior node) with ranks on n0, n1 and n2 and a
    standby beside them: n0 cut off, then the supervisor SIGKILLed. Nothing can tell the others
    (no launcher, no connection reaches them): their ranks and standby ranks end by their
    leases; once n0 is healed, nothing of the job is left on any host."""
    config = bed_config(tmp_path, bed, bed.hosts[:3], [], worker={"train_iters": 100000})
    command = [sys.executable, "-m", "supervisor", "run", str(config), "--quiet"]
    proc = bed.popen("n0", command, cwd=str(REPO), env=supervisor_env(), stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)  # fmt: skip
    run = tmp_path / "run"
    try:
        metrics = run / "attempts" / "000" / "metrics-0.jsonl"
        ready = lambda: any(e["event"] == "standby_ready" for e in events(run))  # noqa: E731
        assert wait_until(lambda: metrics.exists() and len(read_metrics(metrics)) >= 6
                          and ready(), 120), events(run)[-5:]  # fmt: skip
        job = of(events(run), "start")[0]["job"]
        supervisor = [p.pid for p in psutil.process_iter(["cmdline"])
                      if p.info["cmdline"] == command]  # fmt: skip
        assert len(supervisor) == 1, supervisor
        before = left_on_hosts(bed, job)
        assert all(before[h]["procs"] for h in bed.hosts[:3]), before
        bed.cut("n0")
        os.kill(supervisor[0], signal.SIGKILL)
        killed = time.monotonic()
        others = ("n1", "n2")
        gone = wait_until(lambda: not any(left_on_hosts(bed, job)[h]["procs"] for h in others),
                          LEASE_S + 5, every=0.25)  # fmt: skip
        took = time.monotonic() - killed
        assert gone, (took, {h: left_on_hosts(bed, job)[h] for h in others})
        print(f"every process of the job on n1 and n2 gone {took:.1f} s after the kill")
        bed.heal("n0")
        assert wait_until(lambda: not any(s["procs"] for s in left_on_hosts(bed, job).values()),
                          30), left_on_hosts(bed, job)  # fmt: skip
    finally:
        bed.heal("n0")
        proc.kill()
        proc.wait(timeout=30)

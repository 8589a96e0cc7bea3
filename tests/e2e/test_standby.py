"""The warm standby end to end: the real supervisor keeps a second real mpiexec job of the worker
waiting beside the running one; the test SIGKILLs the running ranks and the standby takes over.

The running attempt is paced by a `slow` fault (it sleeps inside each step; the numbers do not
change) so that the standby is ready before the kill on a loaded 2-core host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

import psutil
import pytest

from contracts.env_names import ENV_MEM_ROOT
from tests.e2e import control_intruder
from tests.support import (
    ITERS,
    TINY,
    TINY_SIZES,
    events,
    rank_pid,
    read_metrics,
    tiered,
    toml_value,
    wait_for,
    wait_for_step,
)
from tests.support import LAYOUTS as SHARED_LAYOUTS
from tests.support import finish_supervisor as _finish
from tests.support import start_supervisor as start


def finish(proc, timeout: float = 150) -> tuple[int, str]:
    return _finish(proc, timeout)


SIZES = TINY_SIZES
LAYOUTS = {
    "fsdp2": (2, {}),
    "hsdp2x2": (4, {"replicate": 2}),
    "fsdp_tp2": (4, {"tp": 2}),
}
# At step 16 of the paced attempt: 24 s after its first step, when its standby started (ready
# in ~18 s here with the host's load at 9).
KILL_ALL = {"name": "kill-all", "at_step": 16, "action": "kill", "target": "all"}
# 1.5 s a step, 24 steps: the standby (ready in ~8 s with 2 ranks here, ~20 s with 4) is ready well
# before the last step; the warm attempt then runs at full speed (the fault fires once).
PACE = {"name": "pace", "at_step": 1, "action": "slow", "target": "all", "delay_s": 1.5,
        "duration_s": 600}  # fmt: skip


def write_config(tmp_path, ranks: int, worker: dict, faults=(PACE,), restart=None, env=None):
    tables = {
        "job": {"name": "s", "run_dir": str(tmp_path / "run")},
        "launch": {"launcher": "mpiexec", "ranks_per_node": ranks},
        "launch.env": {"OMP_NUM_THREADS": "1", **(env or {})},
        "worker": {"model": "debug", "device": "cpu", **SIZES, **worker},
        "restart": {
            "max_restarts": 3,
            "teardown_grace_s": 1.0,
            "backoff_s": [0],
            "standby": True,
            **(restart or {}),
        },  # fmt: skip
        "heartbeat": {"interval_s": 0.25, "timeout_s": 5.0},
        "heartbeat.progress": {"init": 120, "load": 120, "train": 60, "save": 120},
    }
    text = "".join(
        f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in t.items()) + "\n"
        for name, t in tables.items()
    )
    text += "".join(
        "[[faults]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in f.items()) + "\n"
        for f in faults
    )
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def kill_ranks(run, attempt: int, ranks: int) -> list[int]:
    pids = [rank_pid(run, r, attempt) for r in range(ranks)]
    for pid in pids:  # a rank may be gone already: its peer's death ended it (seen under load)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def all_losses(run) -> dict[int, list[float]]:
    """Every rank-0 record of every attempt, by step (a recomputed step appears twice)."""
    out: dict[int, list[float]] = {}
    for adir in sorted((run / "attempts").iterdir()):
        for r in read_metrics(adir / "metrics-0.jsonl"):
            out.setdefault(r["step"], []).append(r["loss"])
    return out


def standby_pids(run, attempt: int) -> list[int]:
    return [e["pid"] for e in events(run) if e["event"] == "rank_hello" and e["attempt"] == attempt]


def standby_processes(run, attempt: int) -> list[psutil.Process]:
    """A standby's launcher and the ranks that said hello, those still there."""
    launch = next(
        e for e in events(run) if e["event"] == "standby_launch" and e["attempt"] == attempt
    )
    procs = []
    for pid in [*standby_pids(run, attempt), *launch["pids"]]:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return procs


def knock_as_the_standby(run, proc, attempt: int, ranks: int) -> subprocess.Popen:
    """A keyless process knocking as each rank of the standby `attempt` on the supervisor's
    control socket, found as a port scan would: the supervisor's listening TCP port that is not
    its heartbeat's."""
    start = wait_for(run, lambda e: e["event"] == "start", proc)
    heartbeat = int(start["heartbeat"].rsplit(":", 1)[1])
    conns = psutil.Process(start["pid"]).net_connections("tcp")
    (port,) = {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN} - {heartbeat}
    intruder = control_intruder.start(f"tcp://127.0.0.1:{port}")
    for rank in range(ranks):
        assert control_intruder.ask(intruder, f"claim {attempt} {rank} 0.05") == "claimed"
    return intruder


def assert_no_standby_survives(run, procs: list[psutil.Process], after: str) -> None:
    _, alive = psutil.wait_procs(procs, timeout=20)
    assert not alive, f"standby processes left after {after}: {alive}"
    exits = [e for e in events(run) if e["event"] == "standby_exit"]
    assert exits and exits[-1]["survivors"] == 0


@pytest.mark.parametrize(
    "layout,before_ckpt",
    tiered([("fsdp2", False), ("fsdp2", True), ("hsdp2x2", False), ("fsdp_tp2", False)],
           ("fsdp2", False)),
)  # fmt: skip
def test_a_warm_relaunch_is_the_same_run(tmp_path, reference, mem_root, layout, before_ckpt):
    """The 4-rank layouts keep the memory tier (a copy every step): their standby takes over
    from the running attempt's memory copies, the resume from memory of those layouts (their
    resume from the durable tier: test_checkpoint's killed runs). Before any checkpoint, the
    kill is a fault on every rank (`target = "all"`: the running attempt's ranks, never the
    waiting standby's), at a paced step the standby is ready by."""
    ranks, par = LAYOUTS[layout]
    memory = ranks == 4
    worker = {**par, "train_iters": ITERS, "save_interval": 1000 if before_ckpt else 5}
    worker["mem_ckpt_interval"] = 0  # the 2-rank cases resume from disk (or from nothing)
    env = {}
    if memory:
        worker["mem_ckpt_interval"] = 1
        env[ENV_MEM_ROOT] = str(mem_root)
    want = reference(ranks, *TINY, *SHARED_LAYOUTS[layout][1], "--train-iters", str(ITERS))

    run = tmp_path / "run"
    faults = (PACE, KILL_ALL) if before_ckpt else (PACE,)
    proc = start(write_config(tmp_path, ranks, worker, faults=faults, env=env))
    intruder = None
    try:
        # Before the standby's ranks connect, a keyless process knocks as each of them (issue 38,
        # item 5): they get their `go` all the same, and it gets nothing.
        intruder = knock_as_the_standby(run, proc, 1, ranks)
        first = wait_for(run, lambda e: e["event"] == "first_step" and e["attempt"] == 0, proc)
        ready = wait_for(run, lambda e: e["event"] == "standby_ready", proc, timeout=120)
        assert ready["mono"] > first["mono"] and ready["attempt"] == 1  # launched after step 1
        assert "model" in ready["prepared"] and "warm-up" in ready["prepared"]
        assert 0 < ready["cpu_s"] < 60, ready  # the CPU its preparation took, as a rank said it
        if not before_ckpt:
            wait_for(run, lambda e: e["event"] == "ckpt_complete" and e["step"] >= 10, proc)
        if memory:  # past the durable step: the memory copies are the newer
            wait_for_step(run / "attempts" / "000" / "metrics-0.jsonl", 12, proc)
        standby = standby_pids(run, 1)
        if not before_ckpt:
            kill_ranks(run, 0, ranks)
        rc, out = finish(proc)
        stolen = control_intruder.ask(intruder, "report")
    finally:
        if proc.poll() is None:
            proc.kill()
        if intruder is not None:
            control_intruder.stop(intruder)
    assert rc == 0, out
    assert stolen == "got 0"
    evs = events(run)
    relaunch = next(e for e in evs if e["event"] == "relaunch")
    assert (relaunch["attempt"], relaunch["mode"]) == (1, "warm")
    assert any(e["event"] == "standby_go" and e["attempt"] == 1 for e in evs)
    assert not any(e["event"] == "launch" and e["attempt"] == 1 for e in evs)  # no cold start
    # The standby's own processes trained on: the pids that said hello as the standby.
    trained = {e["pid"] for e in evs if e["event"] == "rank_hello" and e["attempt"] == 1}
    assert trained == set(standby)
    resumed = [e for e in evs if e["event"] == "resumed" and e["attempt"] == 1]
    if before_ckpt:
        assert not resumed  # nothing to resume: the standby started fresh
        fault = next(e for e in evs if e["event"] == "fault" and e["name"] == "kill-all")
        assert fault["attempt"] == 0 and fault["ranks"] == list(range(ranks))
        assert ready["mono"] < fault["mono"], "the standby was not ready by the fault"
        before = [e["event"] for e in evs if e["mono"] <= fault["mono"] + 0.5]
        assert "standby_lost" not in before
    elif memory:
        # At most the step in flight and one copy lost (test_checkpoint's killed runs).
        killed = next(e for e in evs if e["event"] == "attempt_end" and e["attempt"] == 0)
        assert resumed and resumed[0]["source"] == "memory", (resumed, out[-3000:])
        assert resumed[0]["step"] >= killed["max_step"] - 2, (resumed, killed)
    else:
        assert resumed and resumed[0]["step"] >= 10
    got = all_losses(run)
    assert set(got) == set(want)
    for step, values in got.items():
        assert all(v == want[step] for v in values), (step, values, want[step])
    md = (run / "report.md").read_text()
    assert "| warm |" in md
    # The standby launched after the take-over ends with the finished job.
    later = [e["attempt"] for e in evs if e["event"] == "standby_launch" and e["attempt"] > 1]
    if later:
        assert_no_standby_survives(run, standby_processes(run, later[-1]), "the job finished")


@pytest.mark.slow
def test_a_lost_standby_is_replaced_without_spending_the_budget(tmp_path):
    run = tmp_path / "run"
    proc = start(write_config(tmp_path, 2, {"train_iters": 500, "save_interval": 10}))
    try:
        wait_for(run, lambda e: e["event"] == "standby_ready" and e["attempt"] == 1, proc)
        kill_ranks(run, 1, 2)  # the standby's ranks
        lost = wait_for(run, lambda e: e["event"] == "standby_lost", proc)
        assert lost["attempt"] == 1 and lost["was_ready"] and lost["retry_in_s"] >= 1
        wait_for(run, lambda e: e["event"] == "standby_ready" and e["attempt"] == 2, proc)
        # The running attempt was never touched by the standby's loss.
        assert not any(e["event"] in ("relaunch", "teardown") for e in events(run))
        procs = standby_processes(run, 2)
        proc.send_signal(signal.SIGTERM)
        rc, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 5, out  # interrupted
    final = next(e for e in events(run) if e["event"] == "supervisor_exit")
    assert final["restarts"] == 0
    assert_no_standby_survives(run, procs, "a SIGTERM to the supervisor")


@pytest.mark.slow
def test_no_standby_process_survives_a_sigkill_of_the_supervisor(tmp_path):
    """(The end of a job that finished, and of one stopped by SIGTERM, are checked by the warm
    relaunch and the lost-standby tests.)"""
    run = tmp_path / "run"
    proc = start(write_config(tmp_path, 2, {"train_iters": 5000, "save_interval": 10}))
    try:
        launch = wait_for(run, lambda e: e["event"] == "standby_launch", proc)
        wait_for(run, lambda e: e["event"] == "standby_ready", proc)
        procs = standby_processes(run, launch["attempt"])
        proc.kill()
        try:
            proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            pytest.fail("the supervisor did not end")
    finally:
        if proc.poll() is None:
            proc.kill()
    _, alive = psutil.wait_procs(procs, timeout=20)
    assert not alive, f"standby processes left after the supervisor's SIGKILL: {alive}"


@pytest.mark.slow
def test_a_kill_before_the_standby_is_ready_relaunches_cold_at_once(tmp_path, reference):
    """The unready standby is dropped beside the cold launch: its ranks stopped at once, the
    launch first, the standby's end once the cold attempt has stepped, and none of its
    processes is left."""
    want = reference(2, *TINY, *SHARED_LAYOUTS["fsdp2"][1], "--train-iters", str(ITERS))
    run = tmp_path / "run"
    proc = start(write_config(tmp_path, 2, {"train_iters": ITERS, "save_interval": 5}))
    try:
        launch = wait_for(run, lambda e: e["event"] == "standby_launch", proc)
        mpiexec = psutil.Process(launch["pids"][0])
        # Its ranks started (forked from the template, they say hello at once), not ready.
        wait_for(run, lambda e: len(standby_pids(run, launch["attempt"])) == 2, proc)
        standby = [mpiexec, *mpiexec.children(recursive=True)]
        standby += [psutil.Process(pid) for pid in standby_pids(run, launch["attempt"])]
        kill_ranks(run, 0, 2)
        assert not any(e["event"] == "standby_ready" for e in events(run)), "a fast host?"
        rc, out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, out
    evs = events(run)
    relaunch = next(e for e in evs if e["event"] == "relaunch")
    assert relaunch["mode"] == "cold" and relaunch["cold_because"] == "the standby was not ready"
    assert "standby_waited_s" not in relaunch  # no standby had been ready: nothing to wait for
    cold, dropped = relaunch["attempt"], launch["attempt"]
    order = [(e["event"], e.get("attempt"), e.get("reason")) for e in evs]
    launched = order.index(("launch", cold, None))
    stepped = order.index(("first_step", cold, None))
    assert order.index(("standby_exit", dropped, "unusable")) > stepped > launched
    _, alive = psutil.wait_procs(standby, timeout=20)
    assert not alive, f"the dropped standby's processes are left: {alive}"
    ended = next(e for e in evs if e["event"] == "standby_exit" and e["attempt"] == dropped)
    assert ended["survivors"] == 0
    got = all_losses(run)
    assert set(got) == set(want)
    for step, values in got.items():
        assert all(v == want[step] for v in values), (step, values, want[step])

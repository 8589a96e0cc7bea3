"""End to end: declared faults, injected by the real supervisor into the real worker (tiny model,
2 ranks, real mpiexec), detected by the path each should take, and the job still completes with
losses bit-exact against an uninterrupted run.

Two jobs carry every trigger and action between them (one attempt per disruptive fault, so the
file stays within a few minutes on 2 cores); each fault is checked through the attempt it hit:
- time: `at_s` kill of all ranks (exit), `every_s` + jitter SIGSTOP of one rank (liveness), and
  a seeded random straggler (`slow`);
- steps: a marker-gated `unmark` killed through the control channel, `term` of node 0 (no steps
  lost), `every_steps` stall (progress), a kill while a checkpoint is being written, and a
  marker-gated `corrupt` (resume falls back).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import (
    TINY_JOB_WORKER,
    events,
    read_metrics,
    run_supervisor,
    toml_table,
    worker_flags,
)

JOB_TIMEOUT = 420

TRAIN_ITERS = 40
# The durable tier's faults and fallbacks: no memory tier (its default, "auto", would serve some
# resumes from a newer memory copy).
WORKER = {**TINY_JOB_WORKER, "train_iters": TRAIN_ITERS, "mem_ckpt_interval": 0}
EXPECTED_PATH = {"kill": "exit", "term": "exit", "corrupt": "exit", "unmark": "exit",
                 "hang": "hang", "stall": "no_progress"}  # fmt: skip

pytestmark = pytest.mark.slow


def write_config(
    tmp_path: Path, faults: list[dict], worker: dict, train_progress_s: float = 3.0
) -> Path:
    text = toml_table("[job]", {"name": "f", "run_dir": str(tmp_path / "run")})
    text += toml_table("[launch]", {"launcher": "mpiexec", "ranks_per_node": 2})
    text += toml_table("[launch.env]", {"OMP_NUM_THREADS": "1"})
    text += toml_table("[worker]", {**WORKER, **worker})
    text += toml_table("[restart]", {"max_restarts": 8, "teardown_grace_s": 1.0, "backoff_s": [0],
                                "max_same_resume": 4, "standby": False})  # fmt: skip
    text += toml_table("[heartbeat]", {"interval_s": 0.25, "timeout_s": 3.0})
    progress = {"init": 120, "load": 120, "train": train_progress_s, "save": 120}
    text += toml_table("[heartbeat.progress]", progress)
    text += "".join(toml_table("[[faults]]", f) for f in faults)
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def run_job(config: Path) -> tuple[int, str]:
    return run_supervisor(config, JOB_TIMEOUT)


@pytest.fixture
def baseline(reference) -> dict[int, float]:
    """Losses of the same training, uninterrupted, without the supervisor."""
    return reference(2, *worker_flags(WORKER))


def attempt_metrics(run: Path) -> dict[int, list[dict]]:
    return {
        int(d.name): read_metrics(d / "metrics-0.jsonl")
        for d in sorted((run / "attempts").iterdir())
        if d.name.isdigit()
    }


def check_bit_exact(run: Path, baseline: dict[int, float]) -> None:
    """Every step every attempt ran (re-run steps included) has the uninterrupted run's loss."""
    seen = set()
    for attempt, records in attempt_metrics(run).items():
        for r in records:
            assert r["loss"] == baseline[r["step"]], f"attempt {attempt} step {r['step']}"
            seen.add(r["step"])
    assert seen == set(range(1, TRAIN_ITERS + 1))


def by_attempt(evs: list[dict], name: str) -> dict[int, dict]:
    return {e["attempt"]: e for e in evs if e["event"] == name}


def check_each_fault(evs: list[dict]) -> list[dict]:
    """Each disruptive fault ended its attempt by its path; pids are that attempt's ranks."""
    faults = [e for e in evs if e["event"] == "fault"]
    ends = by_attempt(evs, "attempt_end")
    hellos = {(e["attempt"], e["rank"]): e["pid"] for e in evs if e["event"] == "rank_hello"}
    for f in faults:
        assert f["pids"] == [hellos[(f["attempt"], r)] for r in f["ranks"]]
        assert len(f["steps"]) == len(f["ranks"]) and "errors" not in f, f
        assert isinstance(f["ts"], float) and isinstance(f["mono"], float)
        if f["action"] in EXPECTED_PATH:
            assert ends[f["attempt"]]["detected_by"] == EXPECTED_PATH[f["action"]], f
    disruptive = [f["attempt"] for f in faults if f["action"] != "slow"]
    assert len(disruptive) == len(set(disruptive))  # one per attempt
    assert evs[-2]["event"] == "fault_summary" and evs[-2]["total"] == len(faults)
    return faults


def test_time_triggers_kill_hang_slow(tmp_path, baseline):
    # The straggler stretches the first attempt by 30 s (40 steps x 0.75 s), so the kill at 22 s
    # lands while it trains, however fast the start; the hang comes due about then too, and
    # waits for the next attempt.
    slow = dict(at_step=1, action="slow", delay_s=0.75, duration_s=45, target="random", seed=2)
    hang = dict(every_s=24, jitter_s=1, count=1, seed=5, action="hang", target="rank:1")
    faults = [
        {"name": "slow", **slow},
        {"name": "kill", "at_s": [22], "action": "kill"},
        {"name": "hang", **hang},
        # A warm relaunch after the kill would finish the job before the hang comes due: the
        # next attempt is paced too.
        {"name": "pace", "at_s": [22], "action": "slow", "delay_s": 0.5, "duration_s": 30,
         "target": "all"},
    ]  # fmt: skip
    # A stopped rank's peers wait in a collective from their last step, which can be up to a
    # beat interval before the stopped rank's last beat: with the progress limit equal to the
    # liveness timeout, their no-progress deadline sometimes came first. The hang is judged
    # by liveness only when the progress limit is longer.
    config = write_config(tmp_path, faults, {"save_interval": 5}, train_progress_s=6.0)
    rc, out = run_job(config)
    assert rc == 0, out[-4000:]
    run = tmp_path / "run"
    evs = events(run)
    fired = {f["name"]: f for f in check_each_fault(evs)}
    assert set(fired) == {"kill", "hang", "slow", "pace"}
    kill, hang, slow = fired["kill"], fired["hang"], fired["slow"]
    assert kill["ranks"] == [0, 1] and kill["signal"] == "SIGKILL" and kill["via"] == ["signal"] * 2
    assert hang["ranks"] == [1] and hang["signal"] == "SIGSTOP"
    assert 23 <= hang["due_s"] <= 25 and kill["due_s"] == 22
    for f in (kill, hang):
        # On time: late only by the time the ranks were not there to be hit (starting up).
        assert f["late_s"] - f["wait_s"] < 1.0, f
        assert abs(f["elapsed_s"] - f["due_s"] - f["late_s"]) < 1e-3
    # The straggler: its target slept 0.75 s in each step; the other rank waited for it. The
    # steps begun a second after the fault was sent (it reaches the rank over the control
    # channel, read at a step's start), within its duration: rank 0 may start a step a little
    # after the slow rank, so a little of the sleep can be behind it.
    assert slow["point"] == {"step": 1} and slow["via"] == ["control"] and slow["attempt"] == 0
    assert slow["slow"] == {"delay_s": 0.75, "duration_s": 45.0}
    records = attempt_metrics(run)[slow["attempt"]]
    slowed = [r["train/dt"] for r in records
              if slow["ts"] + 1.0 <= r["t"] - r["train/dt"] <= slow["ts"] + 40][:3]  # fmt: skip
    assert len(slowed) == 3 and min(slowed) >= 0.9 * 0.75, slowed
    check_bit_exact(run, baseline)


def test_step_triggers_unmark_term_stall_kill_in_save_corrupt(tmp_path, baseline):
    faults = [
        {
            "name": "unmark",
            "at_step": 7,
            "after_checkpoint": True,
            "action": "unmark",
            "via": "control",
        },  # fmt: skip
        {"name": "term", "at_step": 14, "action": "term", "target": "node:0"},
        {"name": "stall", "every_steps": 25, "action": "stall", "target": "rank:0"},
        {
            "name": "in-save",
            "during": "save",
            "at_step": 30,
            "action": "kill",
            "target": "rank:1",
            "via": "control",
        },  # fmt: skip
        {
            "name": "corrupt",
            "at_step": 33,
            "after_checkpoint": True,
            "action": "corrupt",
            "target": "rank:1",
        },  # fmt: skip
    ]
    config = write_config(tmp_path, faults, {"save_interval": 5, "ckpt_keep": 20})
    rc, out = run_job(config)
    assert rc == 0, out[-4000:]
    run = tmp_path / "run"
    evs = events(run)
    fired = {f["name"]: f for f in check_each_fault(evs)}
    assert set(fired) == {"unmark", "term", "stall", "in-save", "corrupt"}
    resumed = {a: e["step"] for a, e in by_attempt(evs, "resumed").items()}
    ends = by_attempt(evs, "attempt_end")

    # Marker-gated: fired once the checkpoint at or past the step had its .complete, not before.
    for name, ckpt in (("unmark", 10), ("corrupt", 35)):
        f = fired[name]
        assert f["marker"]["step"] == ckpt and f["marker"]["mtime"] <= f["ts"], f
        assert f["step"] >= ckpt and f["damaged"]["step"] == ckpt
        # The damaged checkpoint is skipped: resume falls back to the one before.
        assert resumed[f["attempt"] + 1] == ckpt - 5
    assert fired["unmark"]["via"] == ["control", "control"]  # the kill that follows, too
    assert fired["corrupt"]["damaged"]["how"] == "truncate"
    assert fired["corrupt"]["damaged"]["file"] == "__1_0.distcp"
    assert (
        "skipping checkpoint step-35"
        in (run / "attempts" / f"{fired['corrupt']['attempt'] + 1:03d}" / "output.log").read_text()
    )

    # Step triggers fire exactly at their step.
    term, stall = fired["term"], fired["stall"]
    assert term["point"] == {"step": 14} and term["step"] == 14 and term["ranks"] == [0, 1]
    assert stall["point"] == {"step": 25} and stall["step"] == 25 and stall["via"] == ["control"]
    # term: the ranks checkpoint where they stop; the next attempt loses no step.
    assert resumed[term["attempt"] + 1] == ends[term["attempt"]]["max_step"]
    # A kill while step 30's checkpoint is written: that one never counts.
    in_save = fired["in-save"]
    assert in_save["point"] == {"save": 30, "step": 30}
    assert resumed[in_save["attempt"] + 1] < 30
    check_bit_exact(run, baseline)

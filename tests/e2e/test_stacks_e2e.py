"""End to end: the stacks a hang and a stall leave before their teardown (real supervisor, real
worker under real mpiexec, tiny model, 2 ranks, declared faults).

One job: rank 1 is SIGSTOPped at step 4 (a `hang`: read from outside with py-spy, its peer dumps
its own), then, in the next attempt, rank 0 stalls inside step 12 (a `no_progress`: both still
run and dump their own). Each of the two attempts leaves a stack file per rank with frames in the
worker's code, and its event's lines say where each rank was; tail, status and the report show
them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from supervisor.watch.stack_text import main_thread, place_of
from tests.support import REPO, TINY_JOB_WORKER, events, toml_value

VENV_BIN = str(Path(sys.executable).parent)
JOB_TIMEOUT = 300


TABLES = {
    "launch": {"launcher": "mpiexec", "ranks_per_node": 2},
    "launch.env": {"OMP_NUM_THREADS": "1"},
    "worker": {**TINY_JOB_WORKER, "train_iters": 16, "save_interval": 5},
    "restart": {"max_restarts": 3, "teardown_grace_s": 1.0, "backoff_s": [0], "standby": False},
    "heartbeat": {"interval_s": 0.25, "timeout_s": 3.0},
    # Longer than the liveness timeout: the SIGSTOP is judged a hang, not its peer's no progress.
    "heartbeat.progress": {"init": 120, "load": 120, "train": 5.0, "save": 120},
}  # fmt: skip
FAULTS = [
    {"name": "stop", "at_step": 4, "action": "hang", "target": "rank:1"},
    {"name": "stall", "at_step": 12, "action": "stall", "target": "rank:0"},
]


def write_config(tmp_path: Path) -> Path:
    tables = {"job": {"name": "stacks", "run_dir": str(tmp_path / "run")}, **TABLES}
    text = "".join(
        f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in t.items()) + "\n"
        for name, t in tables.items()
    )
    text += "".join(
        "[[faults]]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in f.items()) + "\n"
        for f in FAULTS
    )
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def supervisor(*args: str, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def in_worker(frame) -> bool:
    return f"{os.sep}worker{os.sep}" in frame.file


def test_a_hang_and_a_stall_leave_every_ranks_stacks(tmp_path):
    run = tmp_path / "run"
    job = supervisor("run", str(write_config(tmp_path)))
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    evs = events(run)
    fired = {e["name"]: e for e in evs if e["event"] == "fault"}
    assert set(fired) == {"stop", "stall"}
    hang = next(e for e in evs if e["event"] == "hang")
    stall = next(e for e in evs if e["event"] == "no_progress")
    assert hang["attempt"] == fired["stop"]["attempt"] and hang["ranks"] == [1]
    assert stall["attempt"] == fired["stall"]["attempt"] != hang["attempt"]

    for e in (hang, stall):
        d = run / "attempts" / f"{e['attempt']:03d}" / "stacks"
        assert e["stacks_dir"] == str(d) and e["stacks_missing"] == []
        assert sorted(p.name for p in d.iterdir()) == ["rank-0.txt", "rank-1.txt"]
        for r in (0, 1):
            text = (d / f"rank-{r}.txt").read_text()
            main = main_thread(text)
            assert main is not None and any(in_worker(f) for f in main.frames), text
            place = place_of(text)
            assert place.own is not None and in_worker(place.own)
            # The event's line for the rank says what its file shows.
            line = next(x for x in e["stacks"] if x.startswith(f"rank {r} "))
            assert place.text() in line, (line, text)

    # The hang: the stopped rank read from outside, its peer (waiting for it in a collective)
    # by its own dump; the stopped rank leads.
    d = run / "attempts" / f"{hang['attempt']:03d}" / "stacks"
    assert hang["stacks"][0].startswith("rank 1 stopped in ")
    assert hang["stacks"][1].startswith("rank 0 running in ")
    assert "py-spy dump --nonblocking" in (d / "rank-1.txt").read_text()
    assert "its own dump (faulthandler" in (d / "rank-0.txt").read_text()
    # The stall: rank 0 blocked in the worker's in-step fault hook, rank 1 waiting for it.
    d = run / "attempts" / f"{stall['attempt']:03d}" / "stacks"
    line0 = next(x for x in stall["stacks"] if x.startswith("rank 0 "))
    assert line0.startswith("rank 0 running in worker/step_commands.py:")
    assert line0.endswith(" apply")
    assert next(x for x in stall["stacks"] if x.startswith("rank 1 ")).startswith("rank 1 running")
    for r in (0, 1):
        assert "its own dump (faulthandler" in (d / f"rank-{r}.txt").read_text()

    # Where people look, without opening a file: tail, status, the report.
    tail = supervisor("tail", str(run), timeout=60).stdout
    for line in hang["stacks"] + stall["stacks"]:
        assert f"\n    {line}\n" in tail
    status = supervisor("status", str(run), timeout=60).stdout
    assert f"  stacks: {stall['stacks_dir']}\n" in status
    assert all(f"    {line}\n" in status for line in stall["stacks"])
    report = (run / "report.md").read_text()
    assert "## Stacks at each hang or no progress" in report
    for e, by in ((hang, "liveness"), (stall, "progress")):
        assert f"(attempt {e['attempt']}, {by}): {'; '.join(e['stacks'])}" in report

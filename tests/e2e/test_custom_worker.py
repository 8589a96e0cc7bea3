"""A user's own training script as `worker.module` (issue 40, item 1): the real supervisor and
real ranks of a tiny custom module (the real beacon, no torch) that knows nothing of the warm
standby. Under the default config (standby on) the job must keep no standby: its ranks, started
with `ES_STANDBY=1`, would train beside the job as a second trainer.
"""

from __future__ import annotations

from pathlib import Path

from tests.support import events, job_toml, run_supervisor, supervisor_cli

STEPS = 60
# Each rank notes that it trains (its attempt, rank, pid and ES_STANDBY), then steps without
# ever saying phase `standby`: what a script written without the supervisor's protocol does.
MY_TRAIN = f"""
import os, time
from worker.beat import Beacon
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
b = Beacon.from_env(rank, world)
b.hello("init")
with open("trainers.log", "a") as f:
    f.write(f"{{os.environ['ES_ATTEMPT']}} {{rank}} {{os.getpid()}} "
            f"{{os.environ.get('ES_STANDBY', '-')}}\\n")
b.phase("train", 0)
for step in range(1, {STEPS} + 1):
    time.sleep(0.05)
    b.step(step, 1.0, 0.05)
b.done(step)
b.close()
"""


def write_job(tmp_path: Path) -> Path:
    """The default config but for the job's own module, its directory and the launcher."""
    (tmp_path / "my_train.py").write_text(MY_TRAIN)
    return job_toml(tmp_path, {
        "job": {"name": "mine", "run_dir": str(tmp_path / "run")},
        "launch": {"launcher": "local", "ranks_per_node": 2, "cwd": str(tmp_path)},
        "worker": {"module": "my_train"},
    })  # fmt: skip


def test_a_custom_worker_without_standby_support_is_one_trainer(tmp_path):
    config = write_job(tmp_path)
    said = supervisor_cli("validate", str(config))
    assert said.returncode == 0, said.stderr
    (note,) = [line for line in said.stdout.splitlines() if "restart.standby" in line]
    assert "'my_train' does not declare standby support" in note, said.stdout

    rc, out = run_supervisor(config, 120)
    assert rc == 0, out[-4000:]
    assert "restart.standby is off: worker.module 'my_train'" in out  # run says it too
    trainers = (tmp_path / "trainers.log").read_text().splitlines()
    assert [line.split()[0] for line in trainers] == ["0", "0"], trainers  # one job: attempt 0
    assert all(line.split()[3] == "-" for line in trainers), trainers  # no ES_STANDBY given
    evs = events(tmp_path / "run")
    assert not [e for e in evs if e["event"].startswith("standby_") and e["event"] != "standby_off"]
    (off,) = [e for e in evs if e["event"] == "standby_off"]
    assert "STANDBY_MODULES" in off["reason"]
    assert sum(e["event"] == "launch" for e in evs) == 1
    assert [e["attempt"] for e in evs if e["event"] == "first_step"] == [0]

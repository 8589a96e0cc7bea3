"""A training script of one's own (docs/worker-protocol.md): the repository's minimal example
(examples/minimal_worker.py, torch-free, the client in worker/beat.py) under the real supervisor
with its own config's kill fault: killed once, relaunched, resumed from its checkpoint, done;
stopped gracefully; refusing a bad flag in one line; and scripts that each break one part of
the protocol, told which part in the attempt's line.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from contracts.exit_codes import ExitCode
from tests.support import (
    REPO,
    events,
    finish_supervisor,
    job_toml,
    run_supervisor,
    start_supervisor,
    supervisor_env,
    wait_for,
)

EXAMPLE = REPO / "examples" / "minimal.toml"


def test_the_minimal_example_is_killed_once_relaunched_and_done(tmp_path):
    run = tmp_path / "run"
    rc, out = run_supervisor(EXAMPLE, 60, "--set", f"job.run_dir={run}", "--no-report")
    assert rc == 0, out[-4000:]
    evs = events(run)
    (fault,) = [e for e in evs if e["event"] == "fault"]
    assert fault["action"] == "kill" and fault["ranks"] == [0, 1]
    assert [e["attempt"] for e in evs if e["event"] == "launch"] == [0, 1]
    ends = [(e["attempt"], e["outcome"]) for e in evs if e["event"] == "attempt_end"]
    assert ends == [(0, "failure"), (1, "success")], ends
    (resumed,) = [e for e in evs if e["event"] == "resumed"]
    assert resumed["attempt"] == 1 and resumed["step"] in (20, 30)  # the save before the kill
    (done,) = [e for e in evs if e["event"] == "done"]
    assert done["step"] == 60 and done["restarts"] == 1
    # Each rank's last save is the uninterrupted run's, bit for bit.
    w = 0.0
    for _ in range(60):
        w += 0.1 * (1.0 - w)
    for r in (0, 1):
        assert (run / "ckpt" / f"rank-{r}.json").read_text() == f'{{"step": 60, "w": {w!r}}}'


def test_the_example_stops_gracefully_and_refuses_bad_input_in_one_line(tmp_path):
    """The stop signal (SIGTERM from the local launcher): the step ends, each rank saves and
    exits 0 without `done`, the job exit 5. A bad flag: exit 2 before any step, the job ends
    with the script's own line and no relaunch."""
    run = tmp_path / "run"
    proc = start_supervisor(EXAMPLE, "--set", f"job.run_dir={run}", "--set", "faults=[]",
                            "--set", "worker.step_s=0.1", "--no-report")  # fmt: skip
    wait_for(run, lambda e: e["event"] == "ckpt_complete", proc, timeout=30)  # the save of 10
    proc.send_signal(signal.SIGINT)
    rc, out = finish_supervisor(proc, 60)
    assert rc == ExitCode.INTERRUPTED, out[-4000:]
    (end,) = [e for e in events(run) if e["event"] == "attempt_end"]
    assert end["outcome"] == "stopped", end
    saved = [json.loads((run / "ckpt" / f"rank-{r}.json").read_text())["step"] for r in (0, 1)]
    assert min(saved) >= 10 and max(saved) < 60, saved  # saved where it stopped, not at the end

    bad = tmp_path / "bad"
    rc, out = run_supervisor(EXAMPLE, 60, "--set", f"job.run_dir={bad}", "--set", "faults=[]",
                             "--set", "worker.train_iters=0", "--no-report")  # fmt: skip
    assert rc == ExitCode.USAGE, out[-4000:]
    (end,) = [e for e in events(bad) if e["event"] == "attempt_end"]
    assert end["outcome"] == "bad_input" and end["error"].startswith("minimal_worker: error:")
    assert not [e for e in events(bad) if e["event"] == "relaunch"]


def test_the_example_needs_no_torch():
    code = "import sys, examples.minimal_worker; print('torch' in sys.modules)"
    said = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO, env=supervisor_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert said.stdout.strip() == "False", said.stderr


HEAD = "import os, time\nfrom worker.beat import Beacon\n"
BEACON = 'b = Beacon.from_env(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))\n'
# Each script breaks one part of the protocol; the attempt's line names that part.
BREACHES = {
    "no_hello": (HEAD + "time.sleep(0.3)\n", "exit 0 and no rank said hello"),
    "no_done": (
        HEAD + BEACON + 'b.hello("init"); b.phase("train", 0); b.step(1, 1.0, 0.1); b.close()\n',
        "exit 0 before the worker said done",
    ),
    "stays_in_init": (
        HEAD + BEACON + 'b.hello("init"); time.sleep(30)\n',
        "said hello, then no phase or step",
    ),
    "no_steps": (
        HEAD + BEACON + 'b.hello("init"); b.phase("train", 0); time.sleep(30)\n',
        "step 0 has not moved in phase 'train'",
    ),
}


@pytest.mark.parametrize("breach", list(BREACHES))
def test_a_script_that_breaks_the_protocol_is_told_which_part(tmp_path, breach):
    script, said = BREACHES[breach]
    (tmp_path / "mine.py").write_text(script)
    config = job_toml(tmp_path, {
        "job": {"name": "mine", "run_dir": str(tmp_path / "run")},
        "launch": {"launcher": "local", "ranks_per_node": 2, "cwd": str(tmp_path)},
        "worker": {"module": "mine"},
        "restart": {"max_restarts": 0},
        "heartbeat": {"interval_s": 0.2},
        "heartbeat.progress": {"init": 1.0, "train": 1.0},
    })  # fmt: skip
    rc, out = run_supervisor(config, 60, "--no-report")
    assert rc == 3, out[-4000:]  # the budget of 0 relaunches spent
    (end,) = [e for e in events(tmp_path / "run") if e["event"] == "attempt_end"]
    assert end["outcome"] == "failure" and said in end["detail"], end["detail"]

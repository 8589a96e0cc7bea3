"""End to end: `python -m supervisor experiment` runs a tiny 3-phase study with real faults.

The real supervisor runs the real worker (tiny model, 2 ranks, mpiexec) three times: baseline,
sync and async, the last two under the same SIGKILL of every rank at step 10 (2 past a
checkpoint). The reports' lost steps and resume steps must equal what the events say (a phase
with several failures: the report tests' synthetic run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.reporting.analysis import analyze
from supervisor.reporting.load import load_run
from tests.support import REPO, events

VENV_BIN = str(Path(sys.executable).parent)
STUDY_TIMEOUT = 420

pytestmark = pytest.mark.slow

CONFIG = """
[experiment]
name = "tiny"
dir = "{dir}"

[launch]
launcher = "mpiexec"
ranks_per_node = 2
env = {{ OMP_NUM_THREADS = "1" }}

[worker]
model = "debug"
device = "cpu"
dim = 32
n_layers = 2
n_heads = 4
n_kv_heads = 2
ffn_dim = 64
vocab_size = 128
seq_len = 32
batch_size = 2
train_iters = 24
save_interval = 4

[restart]
max_restarts = 4
backoff_s = [0]
standby = false
teardown_grace_s = 1.0

[heartbeat]
interval_s = 0.25
timeout_s = 3.0

[heartbeat.progress]
init = 90
load = 90
train = 30
save = 60

[[faults]]
name = "kill-all"
at_step = [10]
action = "kill"
target = "all"
"""


def test_three_phase_study_end_to_end(tmp_path: Path) -> None:
    exp = tmp_path / "exp"
    config = tmp_path / "tiny.toml"
    config.write_text(CONFIG.format(dir=exp))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    try:
        p = subprocess.run(
            [sys.executable, "-m", "supervisor", "experiment", str(config), "--quiet"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=STUDY_TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the study did not finish in {STUDY_TIMEOUT} s: {exc.stdout}")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert {"baseline", "sync", "async", "comparison.md", "comparison.png"} <= {
        x.name for x in exp.iterdir()
    }
    base = load_run(exp / "baseline")
    b = analyze(base)
    assert b.failures == [] and b.checkpoints.saves == [] and b.totals.final_step == 24
    assert not any(e["event"] == "fault" for e in base.events)
    for phase in ("sync", "async"):
        run = exp / phase
        evs = events(run)
        faults = [e for e in evs if e["event"] == "fault"]
        assert [e["point"]["step"] for e in faults] == [10]
        a = analyze(load_run(run), base)
        assert a.mode == phase and len(a.failures) == 1 and a.totals.final_step == 24
        for f in a.failures:
            end = next(e for e in evs if e["event"] == "attempt_end" and e["attempt"] == f.attempt)
            resumed = next(
                e for e in evs if e["event"] == "resumed" and e["attempt"] == f.attempt + 1
            )
            fault = next(e for e in faults if e["attempt"] == f.attempt)
            assert f.fault and f.cause == "fault kill-all: kill all"
            assert f.detected_by == "exit"
            assert f.resumed_from == resumed["step"]
            assert f.step_at_failure == end["max_step"]
            assert f.lost_steps == end["max_step"] - resumed["step"]
            assert f.restart_s == resumed["restart_seconds"]
            # Resumed from the newest checkpoint marked when the fault fired: work was lost.
            assert resumed["step"] >= fault["ckpt_complete"] and f.lost_steps >= 1
            assert f.step_at_failure >= fault["point"]["step"]
            assert 0 < f.downtime_s and f.detection_s < 5
        assert a.totals.overhead_s is not None
        assert (run / "report.md").is_file()
        png = (run / "report.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    comparison = (exp / "comparison.md").read_text()
    assert "async ÷ sync stall per save" in comparison and "## Per failure: async" in comparison
    assert comparison in p.stdout

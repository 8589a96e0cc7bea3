"""End to end: limits learned from the run (`"auto"`, issue 17) with the real supervisor, worker
(tiny model, 2 ranks) and mpiexec. A stall inside a step, injected once the limit is learned, is
found by the progress path under the learned limit, far below the maximum it would otherwise
wait for; the liveness timeout, learned too, finds nothing that was not injected."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO, events, toml_value

VENV_BIN = str(Path(sys.executable).parent)
JOB_TIMEOUT = 420
MAX_TRAIN_S = 60.0  # what the train limit is until learned: a stall found by it takes a minute

WORKER = {
    "model": "debug",
    "device": "cpu",
    "dim": 32,
    "n_layers": 2,
    "n_heads": 2,
    "n_kv_heads": 1,
    "vocab_size": 256,
    "seq_len": 32,
    "batch_size": 2,
    "train_iters": 70,
    "save_interval": 10,
}

pytestmark = pytest.mark.slow


def table(header: str, items: dict) -> str:
    return f"{header}\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in items.items()) + "\n"


def write_config(tmp_path: Path, faults: list[dict]) -> Path:
    text = table("[job]", {"name": "auto", "run_dir": str(tmp_path / "run")})
    text += table("[launch]", {"launcher": "mpiexec", "ranks_per_node": 2})
    text += table("[launch.env]", {"OMP_NUM_THREADS": "1"})
    text += table("[worker]", WORKER)
    text += table("[restart]", {"max_restarts": 3, "teardown_grace_s": 1.0, "backoff_s": [0],
                                "standby": False})  # fmt: skip
    text += table("[heartbeat]", {"interval_s": 0.25, "timeout_s": "auto"})
    text += table("[heartbeat.progress]", {"init": 120, "load": 120, "train": "auto", "save": 120})
    text += table("[heartbeat.auto_max]", {"timeout_s": 10, "train": MAX_TRAIN_S})
    text += "".join(table("[[faults]]", f) for f in faults)
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def run_job(config: Path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "run", str(config)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"supervisor did not finish in {JOB_TIMEOUT} s:\n{out[-4000:]}")
    return proc.returncode, out


def test_a_stall_is_found_under_the_learned_train_limit(tmp_path):
    # Step 45: past the warm-up and the samples the limit needs (5 + 20 step gaps).
    stall = {"name": "stall", "at_step": 45, "action": "stall", "target": "rank:0"}
    rc, out = run_job(write_config(tmp_path, [stall]))
    assert rc == 0, out[-4000:]
    evs = events(tmp_path / "run")
    (fault,) = [e for e in evs if e["event"] == "fault"]
    attempt = fault["attempt"]
    findings = [e for e in evs if e["event"] in ("hang", "no_progress")]
    assert [(e["event"], e["attempt"]) for e in findings] == [("no_progress", attempt)], findings
    (found,) = findings
    end = next(e for e in evs if e["event"] == "attempt_end" and e["attempt"] == attempt)
    assert end["detected_by"] == "no_progress"

    # The finding names the learned limit: the last one said before it, in its attempt.
    said = [e for e in evs if e["event"] == "auto_limit" and e["attempt"] == attempt
            and e["mono"] < found["mono"]]  # fmt: skip
    train = [e for e in said if e["limit"] == "train"]
    assert train, said
    limit = re.search(r"\(timeout ([\d.]+) s, auto\)", found["reason"])
    assert limit, found["reason"]
    assert float(limit.group(1)) == pytest.approx(train[-1]["seconds"], abs=0.006)
    assert train[-1]["seconds"] < MAX_TRAIN_S and train[0]["previous_s"] == MAX_TRAIN_S
    assert train[-1]["samples"] >= 20 and train[-1]["p99_step_s"] > 0
    # The liveness timeout was learned too, and found nothing (the stalled rank kept beating).
    assert any(e["limit"] == "timeout_s" for e in said)

"""The README's demo, run from the shipped config as it is: it must show its failures every
time, on any host, so that it can never silently stop demonstrating."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.log.events import read_events
from tests.support import REPO

DEMO = REPO / "configs" / "debug.toml"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_demo_shows_three_kinds_of_failure_and_finishes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ES_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # mpiexec
    proc = subprocess.run(
        [sys.executable, "-m", "supervisor", "run", str(DEMO)],
        cwd=tmp_path,  # the config's run_dir (runs/{name}-{time}) lands here
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    evs = list(read_events(run / "events.jsonl"))
    faults = [e for e in evs if e["event"] == "fault"]
    assert [f["action"] for f in faults] == ["kill", "hang", "stall"]
    ends = [e for e in evs if e["event"] == "attempt_end"]
    assert [e["detected_by"] for e in ends if e["outcome"] != "success"] == [
        "exit", "hang", "no_progress"
    ]  # fmt: skip
    assert sum(e["event"] == "relaunch" for e in evs) == 3
    resumed = [e["step"] for e in evs if e["event"] == "resumed"]
    assert len(resumed) == 3 and all(step > 0 for step in resumed)  # from a checkpoint each
    assert evs[-1]["event"] == "supervisor_exit" and evs[-1]["code"] == 0
    # A healthy model under kills, a hang and a stall: no bad step, no straggler.
    assert not [e for e in evs if e["event"] in ("numeric_fault", "rollback", "straggler")]

    report = (run / "report.md").read_text()
    for name, path in (("kill-all-after-ckpt", "exit"), ("hang-rank1", "liveness"),
                       ("stall-rank0", "progress")):  # fmt: skip
        row = next(line for line in report.splitlines() if f"fault {name}:" in line)
        assert f"| {path} |" in row
    assert (run / "report.png").stat().st_size > 0

    out = proc.stdout.strip().splitlines()
    summary = out[out.index(next(line for line in out if line.startswith("== debug: DONE"))) :]
    assert "3 failures (3 injected), 3 relaunches" in summary[1]
    assert len(summary) <= 12 and "Report: runs/" in "\n".join(summary)

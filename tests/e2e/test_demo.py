"""The README's demo, run from the shipped config as it is: it must show its failures every
time, on any host, so that it can never silently stop demonstrating. Its console summary has
the shape of the README's sample, line by line (numbers, times, paths and each relaunch's mode
and resume tier masked), and every field of its events is in docs/architecture.md's table."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.log.events import read_events
from tests.support import REPO
from tests.unit.test_event_fields import COMMON, documented

DEMO = REPO / "configs" / "debug.toml"
# What varies from run to run in the summary, masked in both (the README says so above it).
_MASKS = [
    (r"runs/debug-\d{8}-\d{6}", "RUN_DIR"),
    (r"\d+(\.\d+)?( (s|ms|min)\b|%)", "T"),
    (r"\d+", "N"),
    (r"\b(step|failure|relaunch|copy|cop)(s|es|ies|y)?\b", r"\1"),
    (r"\b(warm|cold)\b", "MODE"),
    (r"\((durable|memory|partner)\)", "(TIER)"),
    (r"^(#N stacks:).*", r"\1"),  # where the ranks stood: a line each
]


def shape(line: str) -> str:
    """A summary line with what varies masked and its spacing collapsed."""
    line = " ".join(line.split())
    for pattern, to in _MASKS:
        line = re.sub(pattern, to, line)
    return line


def readme_sample() -> list[str]:
    """The README's sample of the demo's console summary."""
    text = (REPO / "README.md").read_text()
    block = next(b for b in text.split("```")[1::2] if "== debug: DONE" in b)
    return block.strip("\n").splitlines()


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
    # The README's sample is this run's shape: the same lines in the same order.
    got, sample = [shape(line) for line in summary], [shape(line) for line in readme_sample()]
    assert got == sample, "README.md's sample differs from this run's summary:\n" + "\n".join(
        summary
    )
    # Every field it wrote is on docs/architecture.md (tests/unit/test_event_fields.py reads the
    # code for the same; this is what one real run wrote).
    page = documented()
    undocumented = {
        (e["event"], key)
        for e in evs
        for key in e
        if key not in COMMON | page.get(e["event"], set())
    }
    assert not undocumented, f"the demo wrote fields docs/architecture.md lacks: {undocumented}"

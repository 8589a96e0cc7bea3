"""`tail -f` as a process, following a hand-made run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from supervisor.commands import cli
from tests.support import REPO, make_run


def test_tail_renders_and_follows(tmp_path, capsys):
    run = make_run(tmp_path, finished=False)
    assert cli.main(["tail", str(run), "-n", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "relaunch" in lines[0] and "launch" in lines[1]
    assert cli.main(["tail", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["event"] == "start"
    follow = subprocess.Popen(
        [sys.executable, "-m", "supervisor", "tail", "-f", str(run)],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        for _ in range(6):
            assert follow.stdout.readline()
        with open(run / "events.jsonl", "a") as f:
            f.write('ne"}\n' + json.dumps({"event": "done", "step": 30, "ts": time.time()}) + "\n")
        line = follow.stdout.readline()  # bounded by the test timeout
        assert "done" in line and "step=30" in line
    finally:
        follow.kill()
        follow.wait(10)

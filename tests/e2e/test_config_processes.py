"""`python -m supervisor` on a bad config: one line, no traceback; and it imports no torch."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import REPO
from tests.support import write_job_toml as write


def test_user_errors_print_one_line_without_traceback(tmp_path):
    path = write(tmp_path, "[launch]\nlauncher = 'mpiexec'\nexecutable = 'no-such-mpiexec'\n")
    errors = []
    for args in (["run", str(path)], ["validate", str(path)], ["run", "--bogus", str(path)]):
        proc = subprocess.run(
            [sys.executable, "-m", "supervisor", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr
        errors.append(proc.stderr.strip())
    expected = f"error: {path}: launch.executable: launcher program 'no-such-mpiexec' not found"
    assert errors[0].startswith(expected) and "\n" not in errors[0]
    assert errors[1] == errors[0]
    assert "unrecognized arguments: --bogus" in errors[2]


def test_supervisor_never_imports_torch():
    code = (
        "import sys, supervisor.commands.cli, supervisor.run.job; sys.exit('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60, cwd=REPO)
    assert proc.returncode == 0

"""`python -m supervisor report|experiment` as a process, and what `run` and `status` import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import REPO


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "supervisor", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_report(run_dir: Path, baseline_dir: Path, tmp_path: Path) -> None:
    p = cli("report", str(run_dir), "--baseline", str(baseline_dir), "--no-plot")
    assert p.returncode == 0, p.stderr
    assert "## Per failure" in p.stdout and (run_dir / "report.md").is_file()
    assert not (run_dir / "report.png").exists()
    p = cli("report", str(tmp_path / "nope"))
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "not a run directory" in p.stderr
    p = cli("report", str(run_dir), "--baseline", str(tmp_path / "nope"))
    assert p.returncode == 2 and "Traceback" not in p.stderr


def test_cli_experiment_bad_config_is_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "x.toml"
    bad.write_text('[experiment]\nphases = ["baseline", "chaos"]\n')
    p = cli("experiment", str(bad))
    assert p.returncode == 2 and "experiment.phases" in p.stderr and "Traceback" not in p.stderr
    bad.write_text('[experiment]\n[worker]\nmodel = "debug"\n[restart]\nmax_restarts = -1\n')
    p = cli("experiment", str(bad))
    assert p.returncode == 2 and "restart.max_restarts" in p.stderr
    p = cli("experiment", str(tmp_path / "none.toml"))
    assert p.returncode == 2 and "no such file" in p.stderr


def test_run_and_status_do_not_import_the_report() -> None:
    code = (
        "import sys, supervisor.commands.cli as c; c.build_parser(); "
        "assert not {'matplotlib', 'supervisor.reporting.load', 'supervisor.reporting.analysis',"
        " 'supervisor.reporting.plot'}"
        " & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)

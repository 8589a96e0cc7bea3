"""Shared helpers: launch the real worker under the real mpiexec, read what it wrote."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.events import read_events

# A model small enough that a 4-rank job on 2 cores takes seconds.
TINY = [
    "--dim",
    "32",
    "--n-layers",
    "2",
    "--n-heads",
    "4",
    "--n-kv-heads",
    "2",
    "--ffn-dim",
    "64",
    "--vocab-size",
    "128",
    "--seq-len",
    "32",
]
LAUNCH_TIMEOUT = 180


def mpiexec() -> str:
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec"
    )
    if not found:
        pytest.skip("mpiexec not found")
    return found


def rank_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ES_", "PMI", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def worker_cmd(ranks: int, *flags: str) -> list[str]:
    return [mpiexec(), "-n", str(ranks), sys.executable, "-m", "worker.train", *flags]


def run_worker(ranks: int, *flags: str, timeout: float = LAUNCH_TIMEOUT, **kw):
    return subprocess.run(
        worker_cmd(ranks, *flags),
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def start_worker(ranks: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        worker_cmd(ranks, *flags),
        env=rank_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(path: Path) -> dict[int, float]:
    """step -> loss; a later record of the same step (after a resume) replaces the earlier."""
    return {r["step"]: r["loss"] for r in read_metrics(path)}


def toml_value(v) -> str:
    """A Python value as TOML, for the configs the supervisor tests write."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(i) for i in v) + "]"
    return str(v)


def events(run: Path) -> list[dict]:
    """A run's events.jsonl; a line still being written is skipped."""
    return list(read_events(run / "events.jsonl"))

"""What one timed run of `bench/soak.py` gives, and the waiting and stopping both systems share.

A run is one system (the project or torchrun), clean or under the trace, for a window of wall
time that starts at rank 0's first step. Each side (`soak_project`, `soak_torchrun`) starts its
system, gives it the trace its own way and fills an `Outcome`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from soak_trace import Fault

FIRST_STEP_TIMEOUT_S = 300
POLL_S = 0.05


@dataclass
class Fired:
    """One failure of the trace as it was given: when (wall clock), how, or why not."""

    fault: Fault
    wall: float | None  # None: not given in the window
    how: str


@dataclass
class Outcome:
    """One run of one system."""

    system: str  # project | torchrun
    clean: bool
    world: int
    t0: float | None = None  # rank 0's first step (wall clock): the window's start
    startup_s: float | None = None  # the launch to the first step
    records: list[dict] = field(default_factory=list)  # rank 0's, each with its `attempt`
    fired: list[Fired] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)  # one per failure (soak.failure_row)
    ended: str = ""  # how the system ended, when it did before the window's end
    # (attempt, step) of each step the guard skipped; of each resume, the step resumed from
    skipped: list[tuple[int, int]] = field(default_factory=list)
    resumes: list[tuple[int, int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    run_dir: Path | None = None
    standby_cpu_s: list[float] = field(default_factory=list)  # each standby's, as it said ready


def wait_first_step(read: Callable[[], list[dict]], proc: subprocess.Popen) -> dict:
    """Rank 0's first metrics record, once it is written."""
    deadline = time.monotonic() + FIRST_STEP_TIMEOUT_S
    while time.monotonic() < deadline:
        got = read()
        if got:
            return got[0]
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} ended ({proc.returncode}) before its first step")
        time.sleep(POLL_S * 4)
    raise SystemExit(f"no first step within {FIRST_STEP_TIMEOUT_S} s")


def sleep_until(wall: float, proc: subprocess.Popen) -> str:
    """Until wall time `wall`; '' or how the process ended before it."""
    while time.time() < wall:
        if proc.poll() is not None:
            return f"exited {proc.returncode} before the window's end"
        time.sleep(min(0.2, max(0.0, wall - time.time())))
    return ""


def stop(proc: subprocess.Popen, terms: int = 2, grace_s: float = 20.0) -> None:
    """SIGTERM (a graceful stop) `terms` times, `grace_s` apart, then SIGKILL of its process
    group; then any process it started that is still there (a rank in a session of its own)."""
    mine = descendants(proc.pid)
    for _ in range(terms):
        if proc.poll() is not None:
            break
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
    for p in mine:  # psutil checks each is still the process it was (pid reuse)
        try:
            p.kill()
        except psutil.Error:
            pass


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def mem_root(tag: str) -> Path:
    """A fresh memory-tier root for one run (in /dev/shm where there is one), removed by
    `drop_mem_root`: a node_loss removes a node's directory under it and nothing else's."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return Path(tempfile.mkdtemp(prefix=f"es-soak-{tag}-", dir=shm))


def drop_mem_root(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)

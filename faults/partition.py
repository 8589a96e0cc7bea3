"""The `partition` fault's hands: the test bed's `cut` and `heal` (`python -m testbed`, run from
the repository), the one way this machine has to pull a node's cable and leave its processes
running. A node that is not a test-bed host cannot be cut: `validate` refuses the fault there
(`problem`).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BED_TIMEOUT_S = 30.0
NEEDS_BED = (
    "partition cuts a node's network link, which only the test bed does on this machine: bring "
    "it up (python -m testbed up N, as root) and run the job on its hosts"
)


def _bed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "testbed", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=BED_TIMEOUT_S,
        check=False,
    )


def bed_hosts() -> set[str]:
    """The test bed's hosts (`python -m testbed status`); empty when none is up."""
    if not (REPO / "testbed").is_dir():
        return set()
    try:
        out = _bed("status")
    except (OSError, subprocess.TimeoutExpired):
        return set()
    lines = out.stdout.splitlines() if out.returncode == 0 else []
    return {line.split()[0] for line in lines[1:] if line.split()}


def problem(nodes: Sequence[str], emulated: bool) -> str | None:
    """Why a partition cannot be laid on this job's nodes; None when it can."""
    if emulated:
        return f"{NEEDS_BED} (emulated nodes share this host's network)"
    hosts = bed_hosts()
    missing = [n for n in nodes if n not in hosts]
    if missing:
        return f"{NEEDS_BED}; not a test-bed host: {', '.join(missing)}"
    return None


def cut(host: str) -> str | None:
    """Pull `host`'s cable; None when done, else why not."""
    return _said(_run("cut", host))


def heal(host: str) -> str | None:
    """Give `host` its link back; None when done, else why not."""
    return _said(_run("heal", host))


def _run(command: str, host: str) -> subprocess.CompletedProcess[str] | str:
    try:
        return _bed(command, host)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"python -m testbed {command} {host}: {exc}"


def _said(out: subprocess.CompletedProcess[str] | str) -> str | None:
    if isinstance(out, str):
        return out
    if out.returncode == 0:
        return None
    return (out.stderr or out.stdout).strip()[-300:] or f"exit status {out.returncode}"


class Partitions:
    """The nodes a `partition` cut off, each healed after its `duration_s` (0: at `heal_all`,
    when the job ends), said in a `partition_healed` event."""

    def __init__(self, emit: Callable[..., None]) -> None:
        self.emit = emit
        self.cut: dict[str, asyncio.TimerHandle | None] = {}

    def cut_off(self, names: Sequence[str], duration_s: float) -> list[str]:
        """Cut each node's link; the errors, one per node that could not be cut."""
        errors = []
        for node in names:
            why = cut(node)
            if why is not None:
                errors.append(f"node {node}: {why}")
                continue
            timer = None
            if duration_s > 0:
                timer = asyncio.get_running_loop().call_later(duration_s, self.heal, node)
            self.cut[node] = timer
        return errors

    def heal(self, node: str) -> None:
        timer = self.cut.pop(node, None)
        if timer is not None:
            timer.cancel()
        why = heal(node)
        facts: dict[str, Any] = {"error": why} if why else {}
        self.emit("partition_healed", node=node, **facts)

    def heal_all(self) -> None:
        for node in list(self.cut):
            self.heal(node)

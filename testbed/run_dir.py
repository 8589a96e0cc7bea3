"""The bed's state on disk, under RUN_DIR, so that any process (the CLI, a test, the launcher
exec, a `down` after a crash) reads the same bed: one small file per fact, plain text, so that
the launcher exec (a shell script) reads them with `cat`.

    bed.json               {"n": N, "head": "vm"}
    etc-hosts              the /etc/hosts every host sees
    hosts/nK/state         up | cut | killed
    hosts/nK/pid           the host's init (its holder) as the machine numbers it
    hosts/nK/pidns         the inode of its PID namespace (guards against a reused pid)
    hosts/nK/mntns         the inode of its mount namespace
    hosts/nK/log           the holder's stderr
    hosts/<address>        -> nK (the launcher exec accepts addresses too)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from testbed.layout import RUN_DIR, BedPlan, plan


@dataclass(frozen=True)
class HostRecord:
    """What the run dir says of one host."""

    name: str
    state: str
    pid: int | None
    pidns: int | None
    mntns: int | None


def host_dir(name: str, root: Path = RUN_DIR) -> Path:
    return root / "hosts" / name


def _write(path: Path, text: str) -> None:
    """Whole or not at all: the launcher exec may read it at any moment."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def create(bed: BedPlan, etc_hosts: str, root: Path = RUN_DIR) -> None:
    (root / "hosts").mkdir(parents=True, exist_ok=True)
    _write(root / "etc-hosts", etc_hosts)
    for h in bed.hosts:
        host_dir(h.name, root).mkdir(exist_ok=True)
        alias = root / "hosts" / h.address
        if not alias.is_symlink():
            alias.symlink_to(h.name)
    _write(root / "bed.json", json.dumps({"n": bed.n, "head": bed.head}) + "\n")


def read_plan(root: Path = RUN_DIR) -> BedPlan | None:
    try:
        saved = json.loads((root / "bed.json").read_text())
        return plan(int(saved["n"]), str(saved["head"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def read_host(name: str, root: Path = RUN_DIR) -> HostRecord:
    d = host_dir(name, root)
    return HostRecord(
        name,
        _read(d / "state") or "killed",
        _int(_read(d / "pid")),
        _int(_read(d / "pidns")),
        _int(_read(d / "mntns")),
    )


def write_host(record: HostRecord, root: Path = RUN_DIR) -> None:
    """The holder's numbers first, the state last: `up` is said only once it can be entered."""
    d = host_dir(record.name, root)
    for key in ("pid", "pidns", "mntns"):
        value = getattr(record, key)
        _write(d / key, f"{value}\n" if value is not None else "")
    _write(d / "state", f"{record.state}\n")


def set_state(name: str, state: str, root: Path = RUN_DIR) -> None:
    _write(host_dir(name, root) / "state", f"{state}\n")


def log_path(name: str, root: Path = RUN_DIR) -> Path:
    return host_dir(name, root) / "log"

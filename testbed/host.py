"""One host's life: start its init (the holder) in its network namespace with new PID, mount
and UTS namespaces, enter it, and end it (every process at once)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import uuid
from pathlib import Path

import testbed.procs as procs
from testbed.commands import BedError
from testbed.layout import SCRATCH, HostPlan, enter_argv
from testbed.network import NETNS_DIR
from testbed.run_dir import HostRecord, host_dir, log_path

HOLDER = Path(__file__).with_name("holder.py")
START_TIMEOUT = 20.0


def start(host: HostPlan, hosts_file: Path, root: Path) -> HostRecord:
    """Start (boot) the host's holder, with a boot id of its own, and wait (bounded) until it
    says it is ready."""
    boot_id = host_dir(host.name, root) / "boot_id"
    boot_id.write_text(f"{uuid.uuid4()}\n")
    argv = [
        "nsenter", f"--net={NETNS_DIR / host.netns}", "--",
        "unshare", "--pid", "--fork", "--mount", "--uts", "--ipc", "--propagation", "private", "--",
        sys.executable, "-I", str(HOLDER), host.name, str(hosts_file), str(SCRATCH), str(boot_id),
    ]  # fmt: skip
    with open(log_path(host.name, root), "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
            start_new_session=True, cwd="/",
        )  # fmt: skip
    line = _first_line(proc, START_TIMEOUT)
    proc.stdout.close()
    if not line.startswith("ready "):
        proc.kill()
        why = log_path(host.name, root).read_text().strip().splitlines()[-1:] or ["no word"]
        raise BedError(f"host {host.name} did not start: {why[0]}")
    pid = int(line.split()[1])
    pidns, mntns = procs.ns_inode(pid, "pid"), procs.ns_inode(pid, "mnt")
    if pidns is None or mntns is None:
        raise BedError(f"host {host.name}: its init {pid} ended as it started")
    return HostRecord(host.name, "up", pid, pidns, mntns)


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    buf = b""
    fd = proc.stdout.fileno()
    while b"\n" not in buf and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        chunk = os.read(fd, 256)
        if not chunk:
            break
        buf += chunk
    return buf.decode(errors="replace").strip()


def alive(record: HostRecord) -> bool:
    """The host's init still runs (and is the same process, not a reused pid)."""
    return record.pid is not None and procs.ns_inode(record.pid, "pid") == record.pidns


def process_count(record: HostRecord) -> int:
    """The host's processes, its init not counted."""
    if not alive(record):
        return 0
    return max(0, len(procs.members("pid", {record.pidns})) - 1)


def pids(record: HostRecord) -> list[int]:
    """The host's processes as the machine numbers them, its init not counted."""
    if not alive(record):
        return []
    return [p for p in procs.members("pid", {record.pidns}) if p != record.pid]


def end(record: HostRecord, timeout: float = 10.0) -> None:
    """Kill the host: its init first (the kernel kills the whole PID namespace at once), then
    whatever still holds its mount namespace (the launcher's nsenter, the holder's unshare), so
    that its tmpfs go."""
    if record.pid is not None and record.pidns is not None:
        procs.kill_init(record.pid, record.pidns)
    kinds = {k: {v} for k, v in (("pid", record.pidns), ("mnt", record.mntns)) if v is not None}
    procs.sweep(kinds, timeout)


def enter(record: HostRecord, argv: list[str], cwd: str | None = None) -> list[str]:
    """The command line running `argv` in the host (in `cwd`, default the caller's). A cut host
    is still entered (a console, not the network); a killed one has nothing to enter."""
    if record.state == "killed" or not alive(record):
        raise BedError(f"host {record.name} is {'killed' if record.state == 'killed' else 'lost'}")
    return enter_argv(record.pid, argv, cwd or os.getcwd())

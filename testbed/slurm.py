"""A Slurm cluster on the bed: `munged` and `slurmctld` on the machine (the head node), one
`slurmd` in each host under its own name and address. Everything it writes lies under
`RUN_DIR/slurm` (configuration, munge key and socket, state, spools, logs), so `down` removes it
with the run dir; the daemons are found by that path on their command lines.

Clients (`salloc`, `srun`, `scontrol`, `squeue`) find the cluster through `SLURM_CONF`
(`slurm_env()`), on the machine and in the hosts alike (the file system is shared).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import testbed.procs as procs
from testbed.commands import BedError
from testbed.layout import HEAD_ADDRESS, RUN_DIR, BedPlan, HostPlan

SLURM_DIR = RUN_DIR / "slurm"
CONF = SLURM_DIR / "slurm.conf"
MUNGE_SOCKET = SLURM_DIR / "munge" / "munge.socket"
PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "scontrol", "squeue")
READY_TIMEOUT = 60.0
PARTITION = "bed"
SEARCH_PATH = f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/bin"  # the daemons live in sbin


def missing() -> str | None:
    """Why Slurm cannot run here (a program not installed), or None."""
    absent = [p for p in PROGRAMS if not shutil.which(p, path=SEARCH_PATH)]
    if absent:
        return (
            f"Slurm is not installed ({', '.join(absent)} missing): run .ci/install-slurm "
            "(apt-get install slurmctld slurmd slurm-client munge)"
        )
    return None


def slurm_env() -> dict[str, str]:
    """What a Slurm client needs to find the bed's cluster."""
    return {"SLURM_CONF": str(CONF)}


def is_on() -> bool:
    """The bed was given a cluster (its configuration is there)."""
    return CONF.exists()


def running() -> bool:
    """The cluster's controller and munged run (their pid files name live processes)."""
    return is_on() and all(_alive(SLURM_DIR / f"{d}.pid") for d in ("slurmctld", "munged"))


def _alive(pid_file: Path) -> bool:
    """The pid file's process runs (a zombie, killed and not yet reaped, does not)."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    return not procs.is_zombie(pid)  # a process gone counts as one too


def conf_text(bed: BedPlan, cpus: int) -> str:
    """Pure: slurm.conf of the bed: the machine the controller, each host a node of `cpus`
    (the machine's cores: the hosts share them), one partition of them all. No cgroups (the
    hosts are namespaces, not machines): processes are tracked by their parent chain."""
    d = SLURM_DIR
    first, last = bed.hosts[0].address, bed.hosts[-1].address
    lines = [
        "ClusterName=estb",
        f"SlurmctldHost={bed.head}({HEAD_ADDRESS})",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"AuthInfo=socket={MUNGE_SOCKET}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"StateSaveLocation={d}/state",
        f"SlurmdSpoolDir={d}/spool/%n",
        f"SlurmctldPidFile={d}/slurmctld.pid",
        f"SlurmdPidFile={d}/slurmd-%n.pid",
        f"SlurmctldLogFile={d}/slurmctld.log",
        f"SlurmdLogFile={d}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/backfill",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "ReturnToService=2",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=5",
        "MessageTimeout=10",
        f"NodeName=DEFAULT CPUs={cpus} State=UNKNOWN",
        *(f"NodeName={h.name} NodeAddr={h.address} NodeHostname={h.name}" for h in bed.hosts),
        f"PartitionName={PARTITION} Nodes={','.join(bed.names())} Default=YES "
        "MaxTime=INFINITE State=UP OverSubscribe=YES",
        f"# hosts {first}..{last}",
    ]
    return "\n".join(line for line in lines if line) + "\n"


def start(bed: BedPlan, popen_in: Callable[[str, list[str]], subprocess.Popen]) -> None:
    """Write the configuration and key, start munged and slurmctld here and a slurmd in every
    host (`popen_in(host, argv)`), and wait until every node is idle."""
    why = missing()
    if why:
        raise BedError(why)
    for sub in ("state", "spool", "munge"):
        (SLURM_DIR / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(SLURM_DIR / "munge", 0o755)
    CONF.write_text(conf_text(bed, os.cpu_count() or 1))
    key = SLURM_DIR / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    os.chmod(key, 0o400)
    _run([_which("munged"), f"--key-file={key}", f"--socket={MUNGE_SOCKET}",
          f"--pid-file={SLURM_DIR / 'munged.pid'}", f"--log-file={SLURM_DIR / 'munged.log'}",
          f"--seed-file={SLURM_DIR / 'munged.seed'}", "--force"], "munged")  # fmt: skip
    _run([_which("slurmctld"), "-f", str(CONF), "-c"], "slurmctld")
    for h in bed.hosts:
        start_slurmd(h, popen_in)
    wait_idle(bed.names())


def start_slurmd(host: HostPlan, popen_in: Callable[[str, list[str]], subprocess.Popen]) -> None:
    """The host's slurmd (a daemon: it leaves the launching process and lives in the host)."""
    (SLURM_DIR / "spool" / host.name).mkdir(parents=True, exist_ok=True)
    proc = popen_in(host.name, [_which("slurmd"), "-f", str(CONF), "-N", host.name])
    if proc.wait(timeout=READY_TIMEOUT) != 0:
        log = SLURM_DIR / f"slurmd-{host.name}.log"
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else ["no log"]
        raise BedError(f"slurmd on {host.name} did not start: {tail[0]}")


def _which(name: str) -> str:
    found = shutil.which(name, path=SEARCH_PATH)
    if not found:
        raise BedError(missing() or f"{name} not found")
    return found


def _run(argv: list[str], what: str) -> None:
    got = subprocess.run(argv, capture_output=True, text=True, timeout=READY_TIMEOUT,
                         stdin=subprocess.DEVNULL, env={**os.environ, **slurm_env()})  # fmt: skip
    if got.returncode != 0:
        raise BedError(f"{what} did not start: {(got.stderr or got.stdout).strip()[-400:]}")


def node_states() -> dict[str, str]:
    """Each node's state as the controller sees it (`sinfo`-like, from scontrol)."""
    got = subprocess.run([_which("scontrol"), "show", "nodes", "--oneliner"], capture_output=True,
                         text=True, timeout=30, env={**os.environ, **slurm_env()})  # fmt: skip
    states = {}
    for line in got.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            states[fields["NodeName"]] = fields.get("State", "")
    return states


def wait_idle(names: list[str], timeout: float = READY_TIMEOUT) -> None:
    """Until every node in `names` is IDLE (or MIXED/ALLOCATED: serving a job) and not DOWN."""
    deadline = time.monotonic() + timeout
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = node_states()
        if all(n in states and usable(states[n]) for n in names):
            return
        time.sleep(0.3)
    raise BedError(f"Slurm nodes not ready in {timeout:g} s: {states or 'no answer'}")


def usable(state: str) -> bool:
    """Pure: a node state (`IDLE`, `MIXED+DRAIN`, ...) that takes jobs."""
    base, *flags = state.split("+")
    return base in ("IDLE", "MIXED", "ALLOCATED") and not {"DRAIN", "NOT_RESPONDING"} & set(flags)


def resume(name: str) -> None:
    """Tell the controller a healed host's node is back (after `kill`, Slurm marks it DOWN)."""
    subprocess.run([_which("scontrol"), "update", f"NodeName={name}", "State=RESUME"],
                   capture_output=True, timeout=30, env={**os.environ, **slurm_env()})  # fmt: skip
    wait_idle([name])


def stop() -> None:
    """End every daemon of the bed's cluster (found by the bed's paths on their command lines:
    a slurmstepd too), here and in the hosts."""
    marks = (str(CONF).encode(), str(MUNGE_SOCKET).encode(), str(SLURM_DIR).encode())
    for pid, cmd in procs.command_lines():
        name = Path(cmd.split(b"\0", 1)[0].decode(errors="replace")).name
        if name in ("munged", "slurmctld", "slurmd", "slurmstepd") and (
            any(m in cmd for m in marks) or name == "slurmstepd" and _stepd_ours(pid)
        ):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _stepd_ours(pid: int) -> bool:
    """A slurmstepd whose working spool is the bed's (its command line names no config)."""
    try:
        return str(SLURM_DIR) in os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        return False

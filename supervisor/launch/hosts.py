"""The job's hosts: this host's names, and the node list from a host file, the config's list or
the batch job (PBS_NODEFILE, SLURM_JOB_NODELIST)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

from contracts.config_table import ConfigError
from supervisor.settings.config import LaunchConfig

_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


def this_host() -> str:
    return socket.gethostname()


def is_this_host(name: str) -> bool:
    return name in _LOCAL_NAMES or name in {socket.gethostname(), socket.getfqdn()}


def free_port() -> int:
    """A TCP port free on this host's loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Below Linux's ephemeral range (its default start; `ip_local_port_range`), above most services.
LISTEN_PORTS = (20000, 32768)
PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def listen_range(ephemeral: str | None) -> tuple[int, int]:
    """Pure: the ports [low, high) MASTER_PORT is drawn from for a rank 0 on another host,
    below that host's ephemeral range (`ephemeral`: the range file's text, read here, as the
    nodes of a cluster are alike): its outgoing connections never take one of these, only a
    listener could."""
    low, high = LISTEN_PORTS
    try:
        first = int((ephemeral or "").split()[0])
    except (IndexError, ValueError):
        return LISTEN_PORTS
    high = min(high, first)
    low = min(low, max(1024, high - 4096))
    return (low, high) if high - low >= 1024 else LISTEN_PORTS


def rendezvous_port(master: str) -> int:
    """MASTER_PORT for ranks whose rank 0 runs on `master`: on this host, a port free here now;
    on another host, where nothing here can check it, a random one of `listen_range` (rank 0's
    TCP store failing to bind it ends that attempt, and the next draws another)."""
    if is_this_host(master):
        return free_port()
    try:
        with open(PORT_RANGE_FILE) as f:
            text = f.read()
    except OSError:
        text = None
    low, high = listen_range(text)
    return random.SystemRandom().randrange(low, high)


def listed_nodes(launch: LaunchConfig, environ: Mapping[str, str], source: str) -> list[str]:
    """The nodes the config or the batch job names: the host file, the list, PBS_NODEFILE,
    SLURM_JOB_NODELIST, else this host."""
    if launch.hostfile:
        return read_hostfile(Path(launch.hostfile), source, "launch.hostfile")
    if isinstance(launch.nodes, list):
        return list(launch.nodes)
    if environ.get("PBS_NODEFILE"):
        return read_hostfile(Path(environ["PBS_NODEFILE"]), source, "launch.nodes")
    if environ.get("SLURM_JOB_NODELIST"):
        return slurm_hosts(environ["SLURM_JOB_NODELIST"], source)
    return [this_host()]


def read_hostfile(path: Path, source: str, key: str) -> list[str]:
    """The distinct host names of a host file, in order (`host`, `host:4`, `host slots=4`)."""
    try:
        lines = path.read_bytes().decode().split("\n")
    except OSError as exc:
        raise ConfigError(source, key, f"cannot read host file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        message = f"host file {path} is not UTF-8 text (byte {exc.start}); give one host a line"
        raise ConfigError(source, key, message) from None
    hosts: list[str] = []
    for n, line in enumerate(lines, 1):
        fields = line.split("#")[0].split()  # "host", "host:4" or "host slots=4"; "# ..." none
        if not fields:
            continue
        name = fields[0].split(":")[0]
        if not name:
            message = f"host file {path} line {n}: no host name in {line.strip()[:40]!r}"
            raise ConfigError(source, key, message)
        if name not in hosts:
            hosts.append(name)
    if not hosts:
        raise ConfigError(source, key, f"host file {path} lists no hosts")
    return hosts


def slurm_hosts(nodelist: str, source: str) -> list[str]:
    """A Slurm node list's host names (`scontrol` expands ranges like `n[1-4]`)."""
    if "[" not in nodelist:
        return [h for h in nodelist.split(",") if h]
    scontrol = shutil.which("scontrol")
    if scontrol:
        out = subprocess.run(
            [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30
        )
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()
    raise ConfigError(
        source,
        "launch.nodes",
        f"cannot expand SLURM_JOB_NODELIST={nodelist!r} without scontrol; "
        "list the nodes explicitly",
    )

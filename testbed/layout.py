"""What a bed of N hosts is, as plain values: names, addresses, interface names, the run dir's
paths and the text of the hosts files. Pure functions only, so that the code that acts (and the
tests) agree on one plan without running anything."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The only address range the bed uses: on this machine nothing else is on 10.233.0.0/24.
SUBNET = "10.233.0"
PREFIX = 24
HEAD_ADDRESS = f"{SUBNET}.1"
FIRST_HOST = 10
MAX_HOSTS = 200
BRIDGE = "estb0"
NETNS_PREFIX = "estb-"
# Where the bed keeps its state; the launcher exec (testbed/ssh) reads the same paths.
RUN_DIR = Path("/run/es-testbed")
# The node-local scratch: one path on every host, a tmpfs of each host's own.
SCRATCH = Path("/var/tmp/es-testbed-local")
HOSTS_FILE = Path("/etc/hosts")
BLOCK_BEGIN = "# >>> es-testbed: the test bed's hosts; `python -m testbed down` removes this block"
BLOCK_END = "# <<< es-testbed"


@dataclass(frozen=True)
class HostPlan:
    """One host: its name, address and the names of its namespace and links."""

    index: int
    name: str
    address: str
    netns: str  # `ip netns` name
    veth: str  # the bridge's end of its link, in the machine's namespace


@dataclass(frozen=True)
class BedPlan:
    """A bed of `n` hosts; `head` is the machine's hostname as the hosts resolve it."""

    n: int
    head: str
    hosts: tuple[HostPlan, ...]

    def host(self, name_or_address: str) -> HostPlan:
        for h in self.hosts:
            if name_or_address in (h.name, h.address):
                return h
        raise KeyError(f"no host {name_or_address!r} in the test bed ({self.names()})")

    def names(self) -> list[str]:
        return [h.name for h in self.hosts]


def plan(n: int, head: str) -> BedPlan:
    if not 1 <= n <= MAX_HOSTS:
        raise ValueError(f"a test bed has 1 to {MAX_HOSTS} hosts, not {n}")
    hosts = tuple(
        HostPlan(k, f"n{k}", f"{SUBNET}.{FIRST_HOST + k}", f"{NETNS_PREFIX}n{k}", f"{BRIDGE}-n{k}")
        for k in range(n)
    )
    return BedPlan(n, head, hosts)


def host_hosts_file(bed: BedPlan) -> str:
    """/etc/hosts inside every host: the hosts by name and the machine's hostname at the bridge
    (MPICH Hydra's proxies connect back to mpiexec by the launching host's name)."""
    lines = [
        "127.0.0.1 localhost",
        "::1 localhost ip6-localhost ip6-loopback",
        f"{HEAD_ADDRESS} {bed.head}",
        *(f"{h.address} {h.name}" for h in bed.hosts),
    ]
    return "\n".join(lines) + "\n"


def without_block(text: str) -> str:
    """`text` less the bed's block (its marker lines and what lies between); every other line
    kept as it was."""
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        stripped = line.rstrip("\r\n")
        if stripped == BLOCK_BEGIN:
            inside = True
        elif inside and stripped == BLOCK_END:
            inside = False
        elif not inside:
            out.append(line)
    return "".join(out)


def with_block(text: str, bed: BedPlan) -> str:
    """`text` with the bed's block at its end (an older block removed first)."""
    kept = without_block(text)
    if kept and not kept.endswith("\n"):
        kept += "\n"
    block = [BLOCK_BEGIN, *(f"{h.address} {h.name}" for h in bed.hosts), BLOCK_END]
    return kept + "\n".join(block) + "\n"


# `sh -c` body run inside a host: go to the caller's directory when the host has it (the file
# system is shared), else to /, then run the command.
ENTER_SCRIPT = 'cd -- "$0" 2>/dev/null || cd /; exec "$@"'


def enter_argv(holder_pid: int, argv: list[str], cwd: str) -> list[str]:
    """The command line that runs `argv` in the namespaces of the host held by `holder_pid`."""
    ns = ["--net", "--mount", "--uts", "--ipc", "--pid"]
    return ["nsenter", "-t", str(holder_pid), *ns, "--", "sh", "-c", ENTER_SCRIPT, cwd, *argv]


def unreachable(host: str) -> str:
    """What ssh says when the host does not answer."""
    return f"ssh: connect to host {host} port 22: No route to host"

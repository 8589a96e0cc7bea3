"""The bed as a whole: bring N hosts up, act on one (kill, cut, heal, enter) and take everything
down again. Every step that changes the bed holds one lock, and the state lives in the run dir,
so a CLI call, a test and a `down` after a crash all see the same bed."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import testbed.etc_hosts as etc_hosts
import testbed.host as host
import testbed.network as network
import testbed.procs as procs
import testbed.run_dir as run_dir
import testbed.slurm as slurm
from testbed.commands import BedError
from testbed.layout import RUN_DIR, SCRATCH, BedPlan, host_hosts_file, plan
from testbed.probe import available

LAUNCHER = Path(__file__).with_name("ssh")
RELAY = Path(__file__).with_name("relay.py")
RELAY_SOCKET = RUN_DIR / "relay.sock"
LOCK_TIMEOUT = 60.0


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """One change to the bed at a time. The lock is on /run itself, so `down` leaves no file."""
    fd = os.open(RUN_DIR.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    why = f"another bed command held the lock {LOCK_TIMEOUT:g} s"
                    raise BedError(why) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


@dataclass(frozen=True)
class HostStatus:
    name: str
    address: str
    state: str  # up | cut | killed | lost (its init died without `kill`)
    processes: int  # its init not counted
    link_up: bool


@dataclass(frozen=True)
class Bed:
    """A bed that is up; its methods act on the machine."""

    plan: BedPlan
    launcher: ClassVar[Path] = LAUNCHER

    @property
    def hosts(self) -> list[str]:
        return self.plan.names()

    def address(self, name: str) -> str:
        return self.plan.host(name).address

    def launcher_args(self) -> list[str]:
        """mpiexec's arguments that start Hydra's proxies in the hosts."""
        return ["-launcher", "ssh", "-launcher-exec", str(LAUNCHER)]

    def record(self, name: str) -> run_dir.HostRecord:
        return run_dir.read_host(self.plan.host(name).name)

    def argv(self, name: str, argv: list[str], cwd: str | None = None) -> list[str]:
        """The command line that runs `argv` in the host (a killed host raises BedError)."""
        return host.enter(self.record(name), argv, cwd)

    def exec(self, name: str, argv: list[str], cwd: str | None = None, **kw):
        """`subprocess.run` of `argv` in the host (pass `timeout`)."""
        return subprocess.run(self.argv(name, argv, cwd), **kw)

    def popen(self, name: str, argv: list[str], cwd: str | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.argv(name, argv, cwd), **kw)

    def pids(self, name: str) -> list[int]:
        """The host's processes as the machine numbers them (its init not counted)."""
        return host.pids(self.record(name))

    def state(self, name: str) -> str:
        rec = self.record(name)
        return "lost" if rec.state != "killed" and not host.alive(rec) else rec.state

    def status(self) -> list[HostStatus]:
        out = []
        for h in self.plan.hosts:
            rec = run_dir.read_host(h.name)
            out.append(HostStatus(h.name, h.address, self.state(h.name),
                                  host.process_count(rec), network.link_is_up(h)))  # fmt: skip
        return out

    def healthy(self) -> bool:
        return all(s.state == "up" and s.link_up for s in self.status())

    def kill(self, name: str) -> None:
        """A lost node: refused by the launcher, its link down (nothing it sends on dying gets
        out), then every process of it killed at once; its /dev/shm and scratch go with it."""
        h = self.plan.host(name)
        with locked():
            rec = run_dir.read_host(h.name)
            run_dir.set_state(h.name, "killed")
            network.set_link(h, up=False)
            host.end(rec)

    def cut(self, name: str) -> None:
        """The host's cable pulled: its processes live on, nothing reaches them."""
        h = self.plan.host(name)
        with locked():
            if run_dir.read_host(h.name).state == "killed":
                raise BedError(f"host {h.name} is killed; `heal` brings it back")
            network.set_link(h, up=False)
            run_dir.set_state(h.name, "cut")

    def heal(self, name: str) -> None:
        """Back up: a killed (or lost) host boots fresh (new init, empty /dev/shm and scratch;
        its slurmd started again and its node resumed where the bed runs Slurm); a cut host gets
        its link back."""
        h = self.plan.host(name)
        with locked():
            rec = run_dir.read_host(h.name)
            booted = rec.state == "killed" or not host.alive(rec)
            if booted:
                run_dir.set_state(h.name, "killed")
                host.end(rec)
                rec = host.start(h, RUN_DIR / "etc-hosts", RUN_DIR)
                run_dir.write_host(rec)
            network.set_link(h, up=True)
            run_dir.set_state(h.name, "up")
            if booted and slurm.running():
                slurm.start_slurmd(h, self._popen_detached)
                slurm.resume(h.name)

    @property
    def slurm(self) -> bool:
        """The bed runs a Slurm cluster (`up(n, slurm=True)`): clients need `slurm_env()`."""
        return slurm.is_on()

    def slurm_env(self) -> dict[str, str]:
        return slurm.slurm_env()

    def _popen_detached(self, name: str, argv: list[str]) -> subprocess.Popen:
        return self.popen(name, argv, cwd="/", stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          env={**os.environ, **slurm.slurm_env()})  # fmt: skip

    def down(self) -> None:
        down()


def current() -> Bed | None:
    """The bed that is up, as the run dir says, else None."""
    saved = run_dir.read_plan()
    return Bed(saved) if saved is not None else None


def up(n: int, slurm_cluster: bool = False) -> Bed:
    """Bring up a bed of `n` hosts (with `slurm_cluster`, a Slurm cluster over them: `slurm.py`).
    A bed that is up already is reused when it has `n` hosts, all up (its cluster started when
    asked for and not running); any other bed (or a leftover of one) is refused: `down` it
    first."""
    why = available() or (slurm.missing() if slurm_cluster else None)
    if why:
        raise BedError(why)
    with locked():
        existing = current()
        if existing is not None:
            if existing.plan.n == n and existing.healthy():
                if slurm_cluster and not slurm.running():
                    slurm.stop()  # what is left of one that died
                    _start_slurm(existing)
                return existing
            states = ", ".join(f"{s.name} {s.state}" for s in existing.status())
            raise BedError(f"a test bed is up ({states}); `python -m testbed down` first")
        if network.bed_netns() or network.bed_links() or RUN_DIR.exists():
            raise BedError("a test bed's leftovers are here; `python -m testbed down` first")
        try:
            bed = plan(n, socket.gethostname())
        except ValueError as e:
            raise BedError(str(e)) from None
        try:
            _build(bed)
            if slurm_cluster:
                _start_slurm(Bed(bed))
        except BaseException:
            with contextlib.suppress(BedError):
                _teardown()  # the first error is the one to see
            raise
        return Bed(bed)


def _start_slurm(bed: Bed) -> None:
    try:
        slurm.start(bed.plan, bed._popen_detached)
    except BaseException:
        slurm.stop()
        shutil.rmtree(slurm.SLURM_DIR, ignore_errors=True)
        raise


def _build(bed: BedPlan) -> None:
    run_dir.create(bed, host_hosts_file(bed))
    SCRATCH.mkdir(parents=True, exist_ok=True)
    network.add_bridge()
    for h in bed.hosts:
        network.add_host(h)
        run_dir.write_host(host.start(h, RUN_DIR / "etc-hosts", RUN_DIR))
    etc_hosts.add(bed)
    _start_relay()


def _start_relay() -> None:
    """The bed's sshd (`relay.py`): how `testbed/ssh` inside a host reaches another host."""
    (RUN_DIR / "python").write_text(sys.executable)
    (RUN_DIR / "root-pidns").write_text(f"{procs.ns_inode(os.getpid(), 'pid')}")
    proc = subprocess.Popen(
        [sys.executable, "-I", str(RELAY), "serve", str(RELAY_SOCKET)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        start_new_session=True, cwd="/",
    )  # fmt: skip
    line = proc.stdout.readline().decode(errors="replace").strip()
    proc.stdout.close()
    if line != "ready":
        proc.kill()
        raise BedError("the bed's relay (testbed/relay.py) did not start")
    (RUN_DIR / "relay.pid").write_text(str(proc.pid))


def _stop_relay() -> None:
    """Every relay of this bed's socket (found by its command line, whichever checkout started
    it: one whose pid file is gone with a run dir removed by hand, or a crash, is found too)."""
    mark = f"relay.py\0serve\0{RELAY_SOCKET}\0".encode()  # by its socket: from any checkout
    for pid, cmd in procs.command_lines():
        if mark in cmd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def down() -> None:
    """Take down whatever bed there is (also after a crash of whoever brought it up): every
    process of every host, the namespaces, links, run dir, scratch dir and /etc/hosts block."""
    with locked():
        _teardown()


def _teardown() -> None:
    saved = run_dir.read_plan()
    records = [run_dir.read_host(name) for name in (saved.names() if saved else [])]
    kinds: dict[str, set[int]] = {
        "net": {i for ns in network.bed_netns() if (i := network.netns_inode(ns)) is not None},
        "pid": {r.pidns for r in records if r.pidns is not None},
        "mnt": {r.mntns for r in records if r.mntns is not None},
    }
    if procs.ns_inode(os.getpid(), "net") in kinds["net"]:
        raise BedError("`down` runs on the machine, not in one of the bed's hosts")
    _stop_relay()
    slurm.stop()  # its daemons first: a slurmd would answer for a host being taken down
    for r in records:  # each host at once, then what is left
        if r.pid is not None and r.pidns is not None:
            procs.kill_init(r.pid, r.pidns)
    procs.sweep(kinds)
    network.remove_all()
    etc_hosts.remove()
    shutil.rmtree(RUN_DIR, ignore_errors=True)
    shutil.rmtree(SCRATCH, ignore_errors=True)
    left = network.bed_netns() + network.bed_links()
    if left or RUN_DIR.exists():
        raise BedError(f"`down` left {left or [str(RUN_DIR)]}")

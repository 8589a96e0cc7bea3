"""A host's init: run by path (`python -I holder.py NAME HOSTS_FILE SCRATCH BOOT_ID`) as PID 1
of the host's new PID, mount, UTS and IPC namespaces. It gives the host its own /proc, /dev/shm,
node-local scratch, /etc/hosts, hostname and boot id (software that tells machines apart by it,
such as UCX's shared memory, must see two hosts), says `ready <its pid on the machine>` on
stdout, then reaps orphans for as long as the host lives. Its death is the host's: the kernel
then kills every process of the PID namespace at once, and the mount namespace (and its tmpfs)
goes with them.

Standard library only, imports nothing of the project: it runs before the host exists."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, stdin=subprocess.DEVNULL)


def make_host(name: str, hosts_file: str, scratch: str, boot_id: str) -> None:
    mount("--make-rprivate", "/")
    mount("-t", "proc", "proc", "/proc")
    mount("-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "shm", "/dev/shm")
    mount("-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "es-testbed-local", scratch)
    mount("--bind", hosts_file, "/etc/hosts")
    mount("-o", "remount,bind,ro", "/etc/hosts")
    mount("--bind", boot_id, "/proc/sys/kernel/random/boot_id")
    socket.sethostname(name)


def reap_forever() -> None:
    """An init's one duty: read the status of every child and orphan that ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            signal.sigtimedwait({signal.SIGCHLD}, 1.0)


def main() -> None:
    name, hosts_file, scratch, boot_id = sys.argv[1:5]
    outer_pid = os.readlink("/proc/self")  # the machine's /proc, before the host's own is mounted
    make_host(name, hosts_file, scratch, boot_id)
    print(f"ready {outer_pid}", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    reap_forever()


if __name__ == "__main__":
    main()

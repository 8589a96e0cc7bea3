"""The bed's sshd: how every `testbed/ssh` reaches a host, from the machine or from inside
another host (from n0, as Hydra's mpiexec does when the supervisor runs on n0, a PBS
mother-superior node). The command runs under this daemon, never under its caller: no process
tree walked from the caller reaches into the host, as none reaches across a network.

A host has its own PID namespace, and Linux lets no process enter a PID namespace that is not
its own or below it: from n0, n1's init cannot be entered. So, as ssh reaches a daemon that
starts the command on the other machine, `testbed/ssh` run inside a host hands its arguments,
directory, environment and standard streams (SCM_RIGHTS) to this daemon over a Unix socket in
the bed's run dir (the file system is shared); the daemon, on the machine, runs `testbed/ssh`
with them there and sends back its exit status. A client that goes away (its caller killed
it) has its command's `testbed/ssh` ended, as sshd hangs up a session whose connection dropped;
on a cut host only once it is healed (sshd would not hear of it before).

    python -I relay.py serve SOCKET      # started by `up`, in the machine's namespaces
    python -I relay.py client ARGS...    # testbed/ssh inside a host

Standard library only, imports nothing of the project (run by path, as `holder.py` is).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from pathlib import Path

SSH = Path(__file__).with_name("ssh")
RUN = Path("/run/es-testbed")  # the bed's run dir (testbed/run_dir.py): each host's state
HEADER = struct.Struct("!I")
MAX_REQUEST = 1 << 20
POLL_S = 0.05


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


# --- the client (testbed/ssh inside a host) ------------------------------------------------------
def client(sock_path: str, args: list[str]) -> int:
    host = next((a for a in args if not a.startswith("-")), "?")
    request = json.dumps({"args": args, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(sock_path)
        fds = array.array("i", [0, 1, 2])
        sock.sendmsg(
            [HEADER.pack(len(request)), request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
        )
        (status,) = HEADER.unpack(_recv_exact(sock, HEADER.size))
    except (OSError, ConnectionError) as exc:
        print(f"ssh: connect to host {host} port 22: {exc}", file=sys.stderr)
        return 255
    return status


# --- the daemon ----------------------------------------------------------------------------------
def serve(sock_path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket: root's alone
    try:
        server.bind(sock_path)
    finally:
        os.umask(old)
    server.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=_session, args=(conn,), daemon=True).start()


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    msg, ancdata, _, _ = conn.recvmsg(HEADER.size, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    if len(msg) < HEADER.size:
        msg += _recv_exact(conn, HEADER.size - len(msg))
    (size,) = HEADER.unpack(msg)
    if size > MAX_REQUEST:
        raise ValueError("request too large")
    return json.loads(_recv_exact(conn, size)), list(fds)


def _session(conn: socket.socket) -> None:
    fds: list[int] = []
    try:
        request, fds = _read_request(conn)
        if len(fds) != 3:
            raise ValueError("three streams expected")
        pid = os.fork()
        if pid == 0:  # the child: the caller's streams, directory and environment
            try:
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                try:
                    os.chdir(request["cwd"])
                except OSError:
                    os.chdir("/")
                env = {**request["env"], "ES_TESTBED_SSH_DIRECT": "1"}
                os.execve(str(SSH), [str(SSH), *request["args"]], env)
            finally:
                os._exit(255)
        for fd in fds:
            os.close(fd)
        fds = []
        status = _wait(pid, conn, _host_of(request["args"]))
        conn.sendall(HEADER.pack(status))
    except (OSError, ValueError, ConnectionError):
        pass
    finally:
        for fd in fds:
            os.close(fd)
        conn.close()


def _host_of(args: list[str]) -> str:
    """The host an ssh command line names (its first word that is not an option), as `client`."""
    return next((a for a in args if not a.startswith("-")), "?").rpartition("@")[2]


def _cut(host: str) -> bool:
    try:
        return (RUN / "hosts" / host / "state").read_text().strip() == "cut"
    except OSError:
        return False


def _wait(pid: int, conn: socket.socket, host: str) -> int:
    """The command's exit status; a client gone first has its command's `testbed/ssh` ended,
    once the host hears of it: at once, or when a cut host is healed."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) & 0xFF
        readable, _, _ = select.select([conn], [], [], POLL_S)
        if readable and not conn.recv(1, socket.MSG_PEEK):  # the client hung up
            while _cut(host) and not os.waitpid(pid, os.WNOHANG)[0]:
                time.sleep(POLL_S)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return 255


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"] and len(argv) == 2:
        serve(argv[1])
        return 0
    if argv[:1] == ["client"] and len(argv) >= 2:
        return client(argv[1], argv[2:])
    print("usage: relay.py serve SOCKET | client SOCKET ARGS...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`python -m worker.template_client MODULE [flags]`: what the launcher starts in a rank's place
when the job keeps fork templates ([restart] template).

It costs an interpreter without torch (tens of milliseconds). It asks its node's template
(worker.template) to fork MODULE's rank from an interpreter that has imported torch and the
training loop already, handing over its command, environment, working directory and every open
descriptor (stdio, MPI's PMI socket), so the rank writes where the launcher reads and talks to
the launcher's proxy as if the launcher had started it. It then stands for the rank: the signals
it gets (a stop, a teardown's SIGTERM) go to the rank, and it ends as the rank ended (the exit
code, or the same signal), so the launcher's view, exit codes and kill order are those of a rank
it started itself. Killed with SIGKILL, it takes the rank along: the template kills a rank
whose client is gone. With no template to answer (none on the node, it died, it is stopped or
silent, or what listens is another user's), it becomes the rank itself, cold: `exec` of
`python -m MODULE`, a stop signal that came meanwhile kept pending for the rank's handler.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import socket
import sys
import time

from contracts import env_names, template_msgs

# Signals a launcher or the supervisor sends a rank, passed on to it.
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGQUIT,
    signal.SIGCONT,
    signal.SIGALRM,
)
PR_SET_PDEATHSIG = 1


CONNECT_WAIT_S = 3.0  # a template launched beside the first attempt may not listen yet
# A template that listens answers once it has imported (the first attempt's clients wait that
# long); one stopped (SIGSTOP) or not answering in this is of no use: the rank starts cold.
REPLY_WAIT_S = 60.0
STOPPED_LOOK_S = 0.5  # how often a client that waits for its answer looks whether it may come
# Signals whose default ends the process: one that comes before the rank exists ends us so.
ENDS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGALRM,
                  signal.SIGUSR1, signal.SIGUSR2})  # fmt: skip


class Forwarder:
    """Signals for the rank: passed on once its pid is known, kept until then."""

    def __init__(self) -> None:
        self.pid: int | None = None
        self.pending: list[int] = []
        for sig in FORWARDED:
            signal.signal(sig, self.handle)

    def handle(self, signum, frame) -> None:
        if self.pid is None:
            self.pending.append(signum)
            return
        with contextlib.suppress(OSError):
            os.kill(self.pid, signum)

    def to(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)

    def restore(self) -> None:
        """Before this process becomes the rank itself: each signal as the rank expects it, and
        one that came meanwhile and would have ended the rank ends us now; a stop signal is
        kept blocked and pending across the exec, for the rank's StopRequest to take."""
        signal.pthread_sigmask(signal.SIG_BLOCK, template_msgs.STOP_SIGNALS)
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        for signum in self.pending:
            if signum in ENDS:
                os.kill(os.getpid(), signum)


def main(argv: list[str]) -> int:
    started = time.time()
    if not argv:
        print("usage: python -m worker.template_client MODULE [flags]", file=sys.stderr)
        return 2
    module, flags = argv[0], argv[1:]
    signals = Forwarder()
    if os.environ.get(env_names.ENV_EXIT_WITH_PARENT) == "1":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    sock = connect(os.environ)
    pid = ask(sock, module, flags, started) if sock is not None else None
    if pid is None:
        signals.restore()
        cold(module, flags)
    signals.to(pid)
    return stand_for(sock, pid)


def connect(env) -> socket.socket | None:
    """A connection to the node's template; None when none listens within CONNECT_WAIT_S, or
    what listens is not our own user's (an abstract name is anyone's to take: our environment,
    the job's key in it, and our descriptors go to no one else)."""
    name = template_msgs.socket_name(env, socket.gethostname())
    deadline = time.monotonic() + CONNECT_WAIT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(name)
            if template_msgs.peer(sock)[1] == os.getuid():
                return sock
            print(
                f"template_client: {name[1:]!r} is another user's; starting the rank cold",
                file=sys.stderr, flush=True,
            )  # fmt: skip
            sock.close()
            return None
        except OSError:
            sock.close()
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def ask(sock: socket.socket, module: str, flags: list[str], started: float) -> int | None:
    """The forked rank's pid; None when the template cannot serve (then the rank starts cold)."""
    fds = open_fds(sock.fileno())
    if len(fds) > template_msgs.MAX_FDS:  # the rank would miss some: start it cold
        sock.close()
        return None
    request = {
        "module": module,
        "argv": flags,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "fds": fds,
        "started": started,
        "client": os.getpid(),
    }
    try:
        template_msgs.send(sock, request, fds)
        reply = template_msgs.receive(sock)[0] if answering(sock) else None
    except (OSError, template_msgs.TemplateError):
        reply = None
    pid = reply.get("pid") if reply else None
    if not isinstance(pid, int) or pid <= 0:
        if reply and isinstance(why := reply.get("refused"), str):
            print(f"template_client: the fork template refused the rank ({why[:300]}); starting "
                  "it cold", file=sys.stderr, flush=True)  # fmt: skip
        sock.close()
        return None
    return pid


def answering(sock: socket.socket) -> bool:
    """Whether the template's answer has come (or its end) before REPLY_WAIT_S, while the
    template is neither stopped nor gone. Given up on, the request is left unserved: the
    template forks for no client that hung up."""
    template, _ = template_msgs.peer(sock)
    deadline = time.monotonic() + REPLY_WAIT_S
    while not select.select([sock], [], [], STOPPED_LOOK_S)[0]:
        if time.monotonic() >= deadline or stopped(template):
            print(
                f"template_client: the fork template (pid {template}) is stopped or does not "
                "answer; starting the rank cold", file=sys.stderr, flush=True,
            )  # fmt: skip
            return False
    return True


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger) or gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t", "Z", "X")
    except (OSError, IndexError):
        return True


def open_fds(own: int) -> list[int]:
    """Every descriptor the launcher left open to the rank: the template's child takes the same
    numbers (Hydra names its PMI socket by number in PMI_FD)."""
    fds = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd == own:
            continue
        try:
            os.fstat(fd)
        except OSError:  # listdir's own descriptor, closed by now
            continue
        fds.append(fd)
    return sorted(fds)


def cold(module: str, flags: list[str]) -> None:
    """No template: this process becomes the rank, as the launcher would have started it."""
    os.execv(sys.executable, [sys.executable, "-m", module, *flags])


def stand_for(sock: socket.socket, pid: int) -> int:
    """Until the template says how the rank ended; then end the same way."""
    try:
        message, _ = template_msgs.receive(sock)
    except (OSError, template_msgs.TemplateError):
        message = None
    if not message:  # the template is gone, and the rank with it (its parent-death signal)
        print(
            f"template_client: the node's fork template ended; rank process {pid} was killed "
            "with it (SIGKILL)", file=sys.stderr, flush=True,
        )  # fmt: skip
        message = {"signal": signal.SIGKILL}
    killed = message.get("signal")
    if isinstance(killed, int) and killed > 0:
        for sig in FORWARDED:
            signal.signal(sig, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(killed, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            os.kill(os.getpid(), killed)
        time.sleep(1)  # a signal whose default is to stop or to be ignored: fall through
    code = message.get("exit")
    return code if isinstance(code, int) else 1


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main(sys.argv[1:]))

"""`python -m worker.template`: a node's fork template ([restart] template).

The supervisor keeps one per node (and spare), a launch of its own. It pays once what every rank
started on the node would pay again: the interpreter and the imports of torch, the training loop
and `torch._dynamo` (which FSDP2 imports at its first shard). Then it waits; for each
`worker.template_client` that the launcher starts in a rank's place, it forks the rank from
itself: a new standby, prepared rank or cold start costs a fork instead of an interpreter and
its imports, and the pages the imports filled are shared, not copied, until written.

What the template holds when it forks: the imported modules and nothing else. No thread (a fork
copies only the thread that forks: the template refuses to fork once it finds a second), no
device context (CUDA and XPU are initialised by the rank after the fork, never here), no process
group, no MPI (the rank initialises MPI through the descriptors its client handed over), no
random state that matters (the worker seeds everything it draws from). Its garbage collector's
objects are frozen before the first fork so that a collection in a rank does not copy them.

Its ranks die with it (PR_SET_PDEATHSIG), and a rank whose client ends is killed at once: the
client is what the launcher owns, so a launcher's SIGKILL reaches the rank too. A rank whose lease
ran out (worker.lease: its node cut off, or its supervisor gone) ends the template first: what
could renew the template's ranks cannot reach the node. It serves only
its own user (SO_PEERCRED) and clients that carry the job's key, and forks only the modules
it was started for. It reads requests without blocking: a local process that connects and
sends slowly or nothing holds up no rank's start.

A forked rank is its client's process in all but its pid: the client's descriptors and no other,
a session of its own, and its stop signals blocked until its StopRequest takes them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import hmac
import os
import selectors
import signal
import socket
import sys
import time
import traceback

from contracts import env_names, template_msgs

# What a client may ask to run: the training program and a prepared rank.
MODULES = ("worker.train", "worker.prepared")
PR_SET_PDEATHSIG = 1
REQUEST_TIMEOUT_S = 10.0  # a client that connected says what it wants within this
MAX_PENDING = 256  # connections that have not said what they want yet; more are closed at once
PR_SET_NAME = 15
ENDING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
STARTED_WITH = template_msgs.start_env(os.environ)  # before any import could change it


def main() -> int:
    env = os.environ
    if not env.get(env_names.ENV_JOB_ID) or not env.get(env_names.ENV_HEARTBEAT_KEY):
        print(
            "error: worker.template forks ranks for a job the supervisor runs ([restart] "
            f"template); {env_names.ENV_JOB_ID} and {env_names.ENV_HEARTBEAT_KEY} are unset",
            file=sys.stderr,
        )
        return 2
    if env.get(env_names.ENV_EXIT_WITH_PARENT) == "1":
        _die_with_parent()
    name = template_msgs.socket_name(env, socket.gethostname())
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(name)  # first: clients that come while we import wait in the backlog
    except OSError as exc:
        print(f"error: fork template socket {name[1:]!r}: {exc.strerror}", file=sys.stderr)
        return 1
    listener.listen(MAX_PENDING)
    key = env[env_names.ENV_HEARTBEAT_KEY]
    inherited = _open_fds() - {listener.fileno()}
    imports()
    return Template(listener, key, inherited).serve()


def imports() -> None:
    """What a cold start of the training program imports, and what FSDP2 imports later."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    import worker.prepared  # noqa: F401
    import worker.standby  # noqa: F401
    from worker import loop  # noqa: F401
    from worker.ckpt.memory import tier  # noqa: F401


class Template:
    """Forks ranks for clients; tells each client its rank's pid and, later, how it ended.

    One thread, one selector: a request is read in whatever pieces arrive (a client that sends
    slowly or never holds up no other, and is dropped after REQUEST_TIMEOUT_S)."""

    def __init__(self, listener: socket.socket, key: str, inherited: set[int]) -> None:
        self.listener, self.key = listener, key
        self.inherited = inherited  # descriptors from our launcher: never a rank's
        self.ranks: dict[int, socket.socket] = {}  # rank pid -> its client's connection
        self.pending: dict[socket.socket, Pending] = {}  # connections still sending a request
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.ending = False
        self.why = ""
        self.frozen = False

    def serve(self) -> int:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in ENDING:
            signal.signal(sig, self._end)
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        print(f"{template_msgs.READY_LINE}, pid {os.getpid()}", flush=True)
        while not self.ending:
            for key, _ in self.selector.select(self._next_deadline()):
                self._ready(key)
            self._expire()
        print(f"template: {self.why}: ending, with {len(self.ranks)} rank(s)", flush=True)
        for pid in list(self.ranks):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return 0

    def _ready(self, key: selectors.SelectorKey) -> None:
        if key.data == "listen":
            self._accept()
        elif key.data == "wake":
            with contextlib.suppress(OSError):
                os.read(self.wake_r, 4096)
            self._reap()
        elif key.data == "request":
            self._read_request(key.fileobj)
        else:
            self._client_readable(key.data, key.fileobj)

    def _end(self, signum, frame) -> None:
        self.ending = True
        self.why = signal.Signals(signum).name

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        _, uid = template_msgs.peer(conn)
        if uid != os.getuid():
            self._say(f"a client refused: a client of uid {uid}")
            conn.close()
            return
        if len(self.pending) >= MAX_PENDING:  # a flood: the client starts its rank cold
            conn.close()
            return
        conn.setblocking(False)
        self.pending[conn] = Pending(time.monotonic() + REQUEST_TIMEOUT_S)
        self.selector.register(conn, selectors.EVENT_READ, "request")

    def _read_request(self, conn: socket.socket) -> None:
        waiting = self.pending[conn]
        try:
            request = waiting.assembler.read(conn)
        except BlockingIOError:
            return
        except (OSError, template_msgs.TemplateError) as exc:
            self._drop(conn, str(exc))
            return
        if request is None:
            return
        self.selector.unregister(conn)
        del self.pending[conn]
        fds = waiting.assembler.fds
        try:
            self._serve_one(conn, request, fds)
        except Exception as exc:  # one bad client never ends the template
            self._say(f"a client refused: {exc}")
            conn.close()
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _serve_one(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        conn.setblocking(True)
        why = self._refusal(request, fds)
        if why is None and _gone(conn):  # it gave up waiting and starts its rank cold
            why = "the client is gone"
        if why is not None:
            self._say(f"a client refused: {why}")
            with contextlib.suppress(OSError):
                template_msgs.send(conn, {"refused": why})
            conn.close()
            return
        pid = self._fork(request, fds, conn)
        self.ranks[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        with contextlib.suppress(OSError):  # a client gone meanwhile: its end kills the rank
            template_msgs.send(conn, {"pid": pid})

    def _next_deadline(self) -> float | None:
        if not self.pending:
            return None
        soonest = min(p.deadline for p in self.pending.values())
        return max(0.0, soonest - time.monotonic())

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c, p in self.pending.items() if p.deadline <= now]:
            self._drop(conn, f"no request within {REQUEST_TIMEOUT_S:.0f} s")

    def _drop(self, conn: socket.socket, why: str) -> None:
        """A connection that sent no usable request: closed, with what it handed over."""
        waiting = self.pending.pop(conn)
        self.selector.unregister(conn)
        for fd in waiting.assembler.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        conn.close()
        self._say(f"a client refused: {why}")

    def _say(self, line: str) -> None:
        print(f"template: {line}", file=sys.stderr, flush=True)

    def _refusal(self, request, fds: list[int]) -> str | None:
        """Why this request is not served (the client then starts its rank cold), or None."""
        env = request.get("env")
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            return "no environment"
        if not hmac.compare_digest(
            env.get(env_names.ENV_HEARTBEAT_KEY, "").encode(), self.key.encode()
        ):
            return "not this job's key"
        if differs := template_msgs.start_env_differs(STARTED_WITH, env):
            return differs
        if request.get("module") not in MODULES:
            return f"module {request.get('module')!r} is not one this template runs"
        argv, wanted = request.get("argv"), request.get("fds")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            return "no command"
        if not _fd_numbers(wanted) or len(wanted) != len(fds):
            return "descriptors missing"
        if not isinstance(request.get("cwd"), str):
            return "no working directory"
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:  # a fork would copy a lock some thread holds: never
            return f"the template runs {threads} threads"
        return None

    def _fork(self, request: dict, fds: list[int], conn: socket.socket) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        if not self.frozen:
            gc.collect()
            gc.freeze()  # the imports' objects: never scanned (so never copied) in a rank
            self.frozen = True
        parent = os.getpid()
        # The rank's stop signals stay blocked in the child until its StopRequest handles them.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, template_msgs.STOP_SIGNALS)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = self._become_rank(request, fds, parent, conn)
            except SystemExit as exc:
                code = _exit_code(exc)
            except BaseException:
                traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return pid

    def _become_rank(self, request: dict, fds: list[int], parent: int, conn) -> int:
        """In the forked child: the client's process in all but its pid (its descriptors and
        only those, a session of its own as the launcher gives each rank), then the module."""
        _die_with_parent()
        if os.getppid() != parent:  # the template died between the fork and the line above
            return 1
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, *ENDING):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a new interpreter has it
        self._close_own(conn)
        _take_fds(fds, request["fds"])
        for fd in self.inherited - set(request["fds"]):
            with contextlib.suppress(OSError):
                os.close(fd)
        with contextlib.suppress(OSError):
            os.setsid()
        _name_process(request["module"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _fresh_stdio()
        from worker import lease, startup

        lease.LEASE.end_with = parent  # fenced, it ends its template too: the node is cut off

        started = request.get("started")
        startup.PROCESS_START = started if isinstance(started, float) else time.time()
        import runpy
        import warnings

        sys.argv = [request["module"], *request["argv"]]
        with warnings.catch_warnings():  # the module is imported already: that is the point
            warnings.filterwarnings("ignore", "'worker.", RuntimeWarning)
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        return 0

    def _close_own(self, conn: socket.socket) -> None:
        """The template's own descriptors, in the child: none is the rank's."""
        self.selector.close()
        self.listener.close()
        for other in [conn, *self.ranks.values(), *self.pending]:
            other.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _client_readable(self, pid: int, conn) -> None:
        """A client's connection only ever ends: the client is gone, so is its rank."""
        try:
            data = conn.recv(1)
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(conn)
            print(f"template: rank {pid}: its client is gone, killing it", flush=True)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.ranks.pop(pid, None)
            if conn is None:
                continue
            ended = (
                {"signal": os.WTERMSIG(status)}
                if os.WIFSIGNALED(status)
                else {"exit": os.waitstatus_to_exitcode(status)}
            )
            with contextlib.suppress(OSError, ValueError, KeyError):
                template_msgs.send(conn, ended)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            conn.close()


@dataclasses.dataclass
class Pending:
    """A connection whose request is still arriving, and when it is dropped."""

    deadline: float
    assembler: template_msgs.Assembler = dataclasses.field(default_factory=template_msgs.Assembler)


def _gone(conn: socket.socket) -> bool:
    """Whether the client hung up (after its request: it gave up and started cold)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _fd_numbers(wanted) -> bool:
    return isinstance(wanted, list) and all(
        type(fd) is int and 0 <= fd < 1000 for fd in wanted
    ) and len(set(wanted)) == len(wanted)  # fmt: skip


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter would exit with (and say) for this SystemExit."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _open_fds() -> set[int]:
    """This process's open descriptors (not the one that listed them, closed by then)."""
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            os.fstat(int(name))
            fds.add(int(name))
    return fds


def _name_process(module: str) -> None:
    """`ps -o comm` and top tell a rank from its template (both run `-m worker.template`)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_NAME, module.encode()[:15], 0, 0, 0)


def _take_fds(fds: list[int], numbers: list[int]) -> None:
    """The client's descriptors at the client's numbers (first moved out of their way)."""
    moved = []
    for fd in fds:
        high = os.dup(fd) if fd >= 1000 else _dup_high(fd)
        os.close(fd)
        moved.append(high)
    for high, number in zip(moved, numbers, strict=True):
        os.dup2(high, number, inheritable=True)
        os.close(high)


def _dup_high(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 1000)


def _fresh_stdio() -> None:
    """Python's stdio objects over descriptors 0-2, which are the client's now."""
    import io

    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(
            raw, encoding="utf-8", errors="backslashreplace", line_buffering=True,
            write_through=unbuffered or fd == 2,
        )  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


if __name__ == "__main__":
    sys.exit(main())

"""Heartbeats from a rank to the supervisor (docs/architecture.md, messages).

The training loop calls a `Beacon`; every call returns at once. A background thread owns the
ZeroMQ PUSH socket (sockets are not thread-safe), drains a bounded queue, sends with NOBLOCK and
linger 0, and sends a `beat` every `interval_s` carrying the latest phase and step, so liveness
(beats) and progress (steps) can be judged apart. When the queue or the socket is full, messages
are dropped and counted: training never waits for the supervisor. Without `ES_HEARTBEAT_ADDR`
`Beacon.from_env` returns a beacon that does nothing.

Faults (faults/): with `ES_CONTROL_ADDR` the same thread also listens on a DEALER socket for signed
commands from the supervisor. A `signal` command is carried out at once, by the thread (the rank
signals itself); `stall` and `slow` must happen inside a step, so they are queued for
`StepFaults.apply`, the training loop's one per-step hook. A standby's `go` and `exit` are handed
to `wait_standby_command`, where the main thread blocks until one comes (worker.standby).

Relays (worker.relay): with `ES_HEARTBEAT_RELAY=1` and more than one rank on the node, local rank
0's thread also binds its node's relay socket and sends the supervisor one summary of the node's
beats per interval instead of its own beats; the node's other ranks send everything to that socket
instead of the supervisor (their control channel, if any, still goes to the supervisor).

This module must not import torch: the supervisor's tests and benchmarks use it as is.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from contracts import control_msgs, env_names, messages, stack_files
from worker import stack_dump
from worker.errors import UsageError
from worker.relay import RelayCore, node_name, relay_address

QUEUE_SIZE = 1024
CLOSE_LINGER_S = 0.5
# A standby's wait looks at the stop flag this often: a signal handler cannot safely wake a
# thread blocked on a lock (it may interrupt the very code that holds it), so the wait is timed.
STOP_CHECK_S = 0.2
_STOP = object()
RELAY_BATCH = 1000  # frames a relay forwards before it looks at its own beat again
RELAY_CLOSE_S = 0.5  # a closing relay waits this long at most for its node's last `done`s


class Beacon:
    """What the training loop tells the supervisor. This base class is the no-op beacon."""

    @classmethod
    def from_env(cls, rank: int, world: int, local_rank: int = 0, local_world: int = 1) -> Beacon:
        """The beacon `ES_*` asks for. `local_rank`/`local_world`: this rank's place on its node
        (a relay needs more than one rank there; local rank 0 is the relay)."""
        env = os.environ
        addr = env.get(env_names.ENV_HEARTBEAT_ADDR)
        if not addr:
            return cls()
        identity = messages.RankIdentity(
            job=env.get(env_names.ENV_JOB_ID, ""),
            attempt=int(env.get(env_names.ENV_ATTEMPT, "0")),
            rank=rank,
            world=world,
            host=socket.gethostname(),
            pid=os.getpid(),
        )
        key = env.get(env_names.ENV_HEARTBEAT_KEY, "").encode()
        interval = float(env.get(env_names.ENV_HEARTBEAT_INTERVAL, "1.0"))
        if env.get(env_names.ENV_EXIT_WITH_PARENT) == "1":
            _die_with_parent()
        control = env.get(env_names.ENV_CONTROL_ADDR) or None
        if env.get(env_names.ENV_HEARTBEAT_RELAY) == "1" and local_world > 1:
            node = node_name(env, identity.host)
            local = relay_address(key, identity.job, identity.attempt, node)
            if local_rank != 0:  # a member: everything to the node's relay
                return ZmqBeacon(local, key, identity, interval, control)
            relay = RelayCore(key, identity, node)
            return ZmqBeacon(addr, key, identity, interval, control, relay=relay, relay_addr=local)
        return ZmqBeacon(addr, key, identity, interval, control)

    def hello(self, phase: str) -> None: ...

    def phase(self, phase: str, step: int) -> None: ...

    def standby(self, prepared: str) -> None:
        """Phase `standby`, saying what this rank holds ready."""
        self.phase("standby", 0)

    def step(self, step: int, loss: float, dt: float) -> None: ...

    def ckpt(self, step: int, state: str) -> None: ...

    def resumed(
        self, step: int, restart_seconds: float, source: str = "durable", why: str | None = None
    ) -> None: ...

    def error(self, message: str) -> None: ...

    def done(self, step: int) -> None: ...

    def close(self) -> None: ...

    def commands(self) -> list[dict[str, Any]]:
        """Control commands for the training loop (stall, slow) received since the last call."""
        return []

    def wait_standby_command(self, stop_requested: Callable[[], bool]) -> str:
        """Block until the supervisor says `go` or `exit` (returned as such), or a stop is
        requested ("stop"). Only a beacon with a control channel can be a standby."""
        raise UsageError(
            f"a standby ({env_names.ENV_STANDBY}=1) needs {env_names.ENV_HEARTBEAT_ADDR} and "
            f"{env_names.ENV_CONTROL_ADDR}: it waits for the supervisor's go or exit"
        )

    @property
    def dropped(self) -> int:
        """Messages not sent because the queue or the socket was full."""
        return 0


class ZmqBeacon(Beacon):
    """The real beacon: a bounded queue in front of one sender thread."""

    def __init__(
        self,
        addr: str,
        key: bytes,
        identity: messages.RankIdentity,
        interval_s: float,
        control_addr: str | None = None,
        relay: RelayCore | None = None,
        relay_addr: str | None = None,
    ) -> None:
        self._addr = addr
        self.relay = relay  # this rank is its node's relay (bound at relay_addr)
        self._relay_addr = relay_addr
        self._control_addr = control_addr
        self._commands: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._standby: queue.SimpleQueue[str] = queue.SimpleQueue()  # go / exit
        self.control_dropped = 0  # control frames that failed verification
        self._key = key
        self._id = identity
        self._interval = max(0.01, interval_s)
        self._queue: queue.Queue[Any] = queue.Queue(QUEUE_SIZE)
        # Read by the sender thread for beats; plain attribute writes are atomic under the GIL.
        self._phase = "init"
        self._step = 0
        self._dropped = 0
        self._last_step_sent = -float("inf")
        self._last_mem_sent = -float("inf")
        self._closed = False
        self._parent = os.getppid()
        self._watch_parent = os.environ.get(env_names.ENV_EXIT_WITH_PARENT) == "1"
        self._wake_r, self._wake_w = os.pipe()  # a byte in it: the queue has something
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="es-beacon", daemon=True)
        self._thread.start()

    # --- called by the training loop -----------------------------------------------------
    def hello(self, phase: str) -> None:
        self._phase = phase
        self._put("hello", phase=phase)

    def phase(self, phase: str, step: int) -> None:
        self._phase, self._step = phase, int(step)
        self._put("phase", phase=phase, step=int(step))

    def standby(self, prepared: str) -> None:
        self._phase, self._step = "standby", 0
        self._put("phase", phase="standby", step=0, prepared=prepared)

    def step(self, step: int, loss: float, dt: float) -> None:
        self._step = int(step)
        if self._id.rank != 0:
            # Other ranks send at most one `step` per interval (their beats carry the step):
            # with short steps and many ranks, step messages would outnumber beats.
            now = time.monotonic()
            if now - self._last_step_sent < self._interval:
                return
            self._last_step_sent = now
        self._put("step", step=int(step), loss=float(loss), dt=float(dt))

    def ckpt(self, step: int, state: str) -> None:
        if state == "memory":
            # Every rank says its memory copies (the supervisor counts a copy every rank holds
            # as progress), at most one an interval: copies may come every step.
            now = time.monotonic()
            if now - self._last_mem_sent < self._interval:
                return
            self._last_mem_sent = now
        self._put("ckpt", step=int(step), state=state)

    def resumed(
        self, step: int, restart_seconds: float, source: str = "durable", why: str | None = None
    ) -> None:
        """`source`: where the state came from, `memory` or `durable`; `why`: what the memory
        tier passed over and why (a slot a rank refused), when it did."""
        extra = {"why": str(why)[: messages.MAX_WHY]} if why else {}
        self._put(
            "resumed",
            step=int(step),
            restart_seconds=float(restart_seconds),
            source=source,
            **extra,
        )

    def error(self, message: str) -> None:
        # Leave room for the envelope under the protocol's size limit.
        self._put("error", message=str(message)[: messages.MAX_MESSAGE_BYTES // 2])

    def done(self, step: int) -> None:
        self._phase, self._step = "done", int(step)
        self._put("done", step=int(step))

    def close(self, timeout: float = 1.0) -> None:
        """Flush what is queued (bounded by `timeout`) and stop the thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            os.close(self._wake_w)

    @property
    def dropped(self) -> int:
        return self._dropped

    def commands(self) -> list[dict[str, Any]]:
        out = []
        while not self._commands.empty():
            out.append(self._commands.get_nowait())
        return out

    def wait_standby_command(self, stop_requested: Callable[[], bool]) -> str:
        if self._control_addr is None:
            return super().wait_standby_command(stop_requested)
        while not stop_requested():
            try:
                return self._standby.get(timeout=STOP_CHECK_S)
            except queue.Empty:
                continue
        return "stop"

    # --- internals -----------------------------------------------------------------------
    def _put(self, kind: str, **fields: Any) -> None:
        if self._closed:
            return
        try:
            self._queue.put_nowait((kind, time.time(), fields))
        except queue.Full:
            self._dropped += 1
            return
        self._wake()

    def _wake(self) -> None:
        """Tell the thread something is queued (one byte; a full pipe already says so)."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass

    def _run(self) -> None:
        import zmq  # imported here so that an unsupervised rank never loads it

        ctx = zmq.Context()
        control = self._open_control(ctx, zmq) if self._control_addr else None
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, QUEUE_SIZE)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        sock.connect(self._addr)
        pull = self._open_relay(ctx, zmq) if self.relay is not None else None
        if pull is None:
            self.relay = None  # none wanted, or its address is taken: this rank beats alone
        # One blocking wait for all: a queued message (the wake pipe), a command, the node's
        # frames (a relay), the next beat. No polling loop: a waiting standby's thread wakes only
        # to beat.
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if control is not None:
            poller.register(control, zmq.POLLIN)
        if pull is not None:
            poller.register(pull, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    if self.relay is None:
                        self._send(
                            sock, zmq, "beat", time.time(), phase=self._phase, step=self._step
                        )
                    else:
                        self._summarize(sock, zmq, now)
                    next_beat = now + self._interval
                    if self._watch_parent and os.getppid() != self._parent:
                        # Our launcher died without taking us along: do not train on alone.
                        os.kill(os.getpid(), signal.SIGKILL)
                wait_ms = max(0.0, next_beat - time.monotonic()) * 1000
                ready = dict(poller.poll(wait_ms))
                if control is not None and control in ready:
                    self._poll_control(control, zmq)
                if pull is not None and pull in ready:
                    self._relay_frames(pull, sock, zmq)
                if self._wake_r in ready and not self._drain(sock, zmq):
                    if pull is not None:
                        self._relay_close(pull, sock, zmq)
                    break
        finally:
            if pull is not None:
                pull.close(linger=0)
            # Give the last messages (`done` above all) a bounded moment to leave.
            sock.close(linger=int(CLOSE_LINGER_S * 1000))
            if control is not None:
                control.close(linger=0)
            ctx.term()
            os.close(self._wake_r)

    def _drain(self, sock: Any, zmq: Any) -> bool:
        """Send what is queued; False once the queue says stop."""
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            if item is _STOP:
                return False
            kind, t, fields = item
            self._send(sock, zmq, kind, t, **fields)

    # --- a node's relay ---------------------------------------------------------------------
    def _open_relay(self, ctx: Any, zmq: Any) -> Any:
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 10 * QUEUE_SIZE)
        sock.setsockopt(zmq.MAXMSGSIZE, messages.MAC_LEN + messages.MAX_MESSAGE_BYTES)
        try:
            sock.bind(self._relay_addr)
        except zmq.ZMQError:
            sock.close(linger=0)
            return None
        path = self._relay_addr.removeprefix("ipc://")
        if not path.startswith("@"):  # a socket file: this user's only
            try:
                os.chmod(path, 0o600)
            except OSError:
                pass
        return sock

    def _summarize(self, sock: Any, zmq: Any, now: float) -> None:
        """The relay's beat: its own beat folded in, then the node's summary to the supervisor."""
        assert self.relay is not None
        self.relay.own("beat", {"phase": self._phase, "step": self._step}, now)
        frame = self.relay.summary_frame(time.time(), now)
        if frame is not None:
            try:
                sock.send(frame, flags=zmq.NOBLOCK)
            except zmq.Again:
                self._dropped += 1

    def _relay_frames(self, pull: Any, sock: Any, zmq: Any) -> None:
        """Fold the node's waiting frames; forward, in order, those that are not summarized."""
        assert self.relay is not None
        take, now = self.relay.take, time.monotonic()
        for _ in range(RELAY_BATCH):
            try:
                frame = pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            out = take(frame, now)
            if out is not None:
                try:
                    sock.send(out, flags=zmq.NOBLOCK)
                except zmq.Again:
                    self._dropped += 1

    def _relay_close(self, pull: Any, sock: Any, zmq: Any) -> None:
        """This rank is done: relay a short while longer, until the node's other ranks said
        `done` (they end together, and their last words go through here), then one last
        summary."""
        assert self.relay is not None
        end = time.monotonic() + RELAY_CLOSE_S
        while time.monotonic() < end:
            ranks = self.relay.ranks
            if all(r.phase == "done" for k, r in ranks.items() if k != self._id.rank):
                break
            if pull.poll(int(1000 * max(0.0, end - time.monotonic()))):
                self._relay_frames(pull, sock, zmq)
        self._summarize(sock, zmq, time.monotonic())

    def _open_control(self, ctx: Any, zmq: Any) -> Any:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(
            zmq.ROUTING_ID, control_msgs.control_identity(self._id.attempt, self._id.rank)
        )
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * messages.MAX_MESSAGE_BYTES)
        sock.connect(self._control_addr)
        return sock

    def _poll_control(self, control: Any, zmq: Any) -> None:
        """Verify each waiting command; signal at once, queue the in-step ones for the loop."""
        while True:
            try:
                frame = control.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            i = self._id
            try:
                cmd = control_msgs.decode_control(self._key, frame, i.job, i.attempt, i.rank)
            except messages.BadMessage:
                self.control_dropped += 1
                continue
            if cmd["action"] == "signal":
                if cmd["signal"] == stack_files.STACKS_SIGNAL and not stack_dump.installed():
                    continue  # its default action would end a process without the handler
                os.kill(os.getpid(), cmd["signal"])
            elif cmd["action"] in control_msgs.STANDBY_ACTIONS:
                self._standby.put(cmd["action"])
            else:
                self._commands.put(cmd)

    def _send(self, sock: Any, zmq: Any, kind: str, t: float, **fields: Any) -> None:
        if self.relay is not None:
            self.relay.own(kind, fields, time.monotonic())
        frame = messages.encode(self._key, self._id.message(kind, t, **fields))
        try:
            sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._dropped += 1


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


class StepFaults:
    """The training loop's per-step hook for the supervisor's in-step faults: `stall` blocks
    inside the step for good (the beat thread keeps beating: progress is lost, liveness is not);
    `slow` sleeps `delay_s` at every step until `duration_s` has passed (a straggler)."""

    def __init__(self, beacon: Beacon) -> None:
        self._beacon = beacon
        self._delay_s = 0.0
        self._slow_until = 0.0

    def apply(self) -> None:
        for cmd in self._beacon.commands():
            if cmd["action"] == "stall":
                while True:
                    time.sleep(1)
            if cmd["action"] == "slow":
                self._delay_s = cmd["delay_s"]
                self._slow_until = time.monotonic() + cmd["duration_s"]
        if self._delay_s and time.monotonic() < self._slow_until:
            time.sleep(self._delay_s)

"""Heartbeats from a rank to the supervisor (docs/architecture.md, messages).

The training loop calls a `Beacon`; every call returns at once. A background thread owns the
ZeroMQ PUSH socket (sockets are not thread-safe), drains a bounded queue, sends with NOBLOCK and
linger 0, and sends a `beat` every `interval_s` carrying the latest phase and step, so liveness
(beats) and progress (steps) can be judged apart. When the queue or the socket is full, messages
are dropped and counted: training never waits for the supervisor. Without `ES_HEARTBEAT_ADDR`
`Beacon.from_env` returns a beacon that does nothing.

The same thread, in the same one blocking wait, serves the rank's other sockets:

- the control channel (`ES_CONTROL_ADDR`, worker.control_channel): the supervisor's signed
  commands; a signal is carried out at once, `stall`, `slow` and the rest reach the training
  loop's one per-step hook (worker.step_commands), and a standby's `go` and `exit` reach
  `wait_standby_command` (worker.standby);
- the node's relay (`ES_HEARTBEAT_RELAY=1` and more than one rank on the node,
  worker.beacon_relay): local rank 0 binds its node's relay socket and sends the supervisor one
  summary of the node's beats per interval instead of its own beats; the node's other ranks send
  everything to that socket instead of the supervisor (their control channel, if any, still goes
  to the supervisor);
- and at every beat it looks whether its launcher is gone (worker.parent_watch), and at every
  wake and when it runs out whether the rank's lease did (worker.lease).

This module must not import torch: the supervisor's tests and benchmarks use it as is.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from contracts import env_names, messages
from worker import lease, parent_watch
from worker.beacon_relay import NodeRelay
from worker.control_channel import ControlChannel
from worker.errors import UsageError
from worker.parent_watch import ParentWatch
from worker.recent_steps import RecentSteps
from worker.relay import RelayCore, node_name, relay_address

QUEUE_SIZE = 1024
CLOSE_LINGER_S = 0.5
_STOP = object()


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
        if parent_watch.wanted():
            parent_watch.die_with_parent()
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

    def timing(self, compute: float, wait: float) -> None:
        """The coming step's compute and wait in collectives (worker.step_clock): its `step`
        message and the beats after it carry them."""

    def costs(self, costs: dict[str, float]) -> None:
        """What copies and saves cost the steps since the last step message, by tier (rank 0:
        the supervisor tunes "auto" intervals by them); the next `step` message carries them."""

    def ckpt(self, step: int, state: str) -> None: ...

    def resumed(
        self, step: int, restart_seconds: float, source: str = "durable", why: str | None = None
    ) -> None: ...

    def error(self, message: str, cause: str | None = None) -> None: ...

    def numeric_fault(
        self, step: int, ranks: list[int], kind: str, value: float | str, what: str, action: str
    ) -> None:
        """Rank 0, for the job: the numerical guard found step `step` bad (not applied)."""

    def rollback(self, from_step: int, to_step: int, skip: str) -> None:
        """Rank 0, for the job: the guard rolled back from the bad step to a checkpoint's."""

    def fault_ack(self, fault: int, step: int, action: str, applied: bool, at: int) -> None:
        """This rank, of the supervisor's `nan` or `spike` for step `step`: applied there, or
        not (it came at step `at`, past it). The supervisor's `fault` event waits for it."""

    def done(self, step: int) -> None: ...

    def close(self) -> None: ...

    def commands(self) -> list[dict[str, Any]]:
        """Control commands for the training loop (stall, slow) received since the last call."""
        return []

    def wait_standby_command(self, stop_requested: Callable[[], bool]) -> dict[str, Any]:
        """Block until the supervisor says `go`, `exit` or `become` (the command is returned),
        or a stop is requested (action "stop"). Only a beacon with a control channel can be a
        standby."""
        raise UsageError(
            f"a standby ({env_names.ENV_STANDBY}=1) needs {env_names.ENV_HEARTBEAT_ADDR} and "
            f"{env_names.ENV_CONTROL_ADDR}: it waits for the supervisor's go or exit"
        )

    @property
    def dropped(self) -> int:
        """Messages not sent because the queue or the socket was full."""
        return 0


class _Push:
    """The PUSH socket to the supervisor (or to the node's relay): a send never waits; one the
    socket cannot take now is dropped and counted."""

    def __init__(self, sock: Any, zmq: Any) -> None:
        self.sock = sock
        self._noblock, self._again = zmq.NOBLOCK, zmq.Again
        self.dropped = 0

    def send(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, flags=self._noblock)
        except self._again:
            self.dropped += 1


class ZmqBeacon(Beacon):
    """The real beacon: a bounded queue in front of one thread that owns every socket (the
    PUSH socket, and the node's relay and the control channel when there are any)."""

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
        # This rank is its node's relay (bound at relay_addr), until the thread fails to bind.
        self._relay = NodeRelay(relay, relay_addr or "") if relay is not None else None
        self._control = ControlChannel(control_addr, key, identity) if control_addr else None
        if control_addr:  # renewed on the control channel: none without it
            lease.start_from_env()
        self._parent = ParentWatch(parent_watch.wanted())
        self._key = key
        self._id = identity
        self._interval = max(0.01, interval_s)
        self._queue: queue.Queue[Any] = queue.Queue(QUEUE_SIZE)
        # Read by the sender thread for beats; plain attribute writes are atomic under the GIL.
        self._phase = "init"
        self._step = 0
        self._timing: dict[str, float] = {}  # the latest step's compute and wait (stragglers)
        self._costs: dict[str, float] = {}  # copies' and saves' costs not sent yet (intervals)
        self._recent = RecentSteps()  # each step's compute since the last message (stragglers)
        self._dropped = 0  # not queued: the queue was full
        self._push: _Push | None = None  # the thread's, once it runs
        self._last_step_sent = -float("inf")
        self._last_mem_sent = -float("inf")
        self._closed = False
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
        # the CPU its preparation took (a new standby's cost to the ranks training beside it)
        cpu_s = round(time.process_time(), 3)
        self._put("phase", phase="standby", step=0, prepared=prepared, cpu_s=cpu_s)

    def step(self, step: int, loss: float, dt: float) -> None:
        if "compute" in self._timing:  # before the step is said: a beat that says it has it
            self._recent.add(int(step), self._timing["compute"])
        self._step = int(step)
        if self._id.rank != 0:
            # Other ranks send at most one `step` per interval (their beats carry the step):
            # with short steps and many ranks, step messages would outnumber beats.
            now = time.monotonic()
            if now - self._last_step_sent < self._interval:
                return
            self._last_step_sent = now
        recent = self._recent.take()
        timing = {**self._timing, "recent": recent} if recent else self._timing
        if self._costs:
            costs, self._costs = self._costs, {}
            timing = {**timing, "cost": costs}
        self._put("step", step=int(step), loss=float(loss), dt=float(dt), **timing)

    def timing(self, compute: float, wait: float) -> None:
        self._timing = {"compute": round(compute, 6), "wait": round(wait, 6)}

    def costs(self, costs: dict[str, float]) -> None:
        for tier, seconds in costs.items():
            self._costs[tier] = round(self._costs.get(tier, 0.0) + seconds, 6)

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

    def error(self, message: str, cause: str | None = None) -> None:
        # Leave room for the envelope under the protocol's size limit.
        said = str(message)[: messages.MAX_MESSAGE_BYTES // 2]
        self._put("error", message=said, **({"cause": cause} if cause else {}))

    def numeric_fault(
        self, step: int, ranks: list[int], kind: str, value: float | str, what: str, action: str
    ) -> None:
        self._put(
            "numeric_fault",
            step=int(step),
            ranks=[int(r) for r in ranks][: messages.MAX_RELAY_RANKS],
            fault=kind,
            value=value,
            what=what,
            action=action,
        )

    def rollback(self, from_step: int, to_step: int, skip: str) -> None:
        self._put("rollback", from_step=int(from_step), to_step=int(to_step), skip=skip)

    def fault_ack(self, fault: int, step: int, action: str, applied: bool, at: int) -> None:
        self._put("fault_ack", fault=fault, step=step, action=action, applied=applied, at=at)

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
        push = self._push
        return self._dropped + (push.dropped if push is not None else 0)

    @property
    def relay(self) -> RelayCore | None:
        """The node's relay state, when this rank is its node's relay."""
        return self._relay.core if self._relay is not None else None

    @property
    def control_dropped(self) -> int:
        """Control frames that failed verification."""
        return self._control.dropped if self._control is not None else 0

    def commands(self) -> list[dict[str, Any]]:
        return self._control.in_step_commands() if self._control is not None else []

    def wait_standby_command(self, stop_requested: Callable[[], bool]) -> dict[str, Any]:
        if self._control is None:
            return super().wait_standby_command(stop_requested)
        return self._control.wait_standby(stop_requested)

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
        control = self._control
        if control is not None:
            control.open(ctx, zmq)
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, QUEUE_SIZE)
        sock.setsockopt(zmq.IMMEDIATE, 0)
        sock.connect(self._addr)
        push = self._push = _Push(sock, zmq)
        relay = self._relay
        if relay is not None and not relay.open(ctx, zmq):
            self._relay = relay = None  # its address is taken: this rank beats alone
        # One blocking wait for all: a queued message (the wake pipe), a command, the node's
        # frames (a relay), the next beat. No polling loop: a waiting standby's thread wakes only
        # to beat.
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if control is not None:
            poller.register(control.socket, zmq.POLLIN)
        if relay is not None:
            poller.register(relay.socket, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    if relay is None:
                        beat = {"phase": self._phase, "step": self._step, **self._timing}
                        if recent := self._recent.take():
                            beat["recent"] = recent
                        self._send("beat", time.time(), **beat)
                    else:
                        relay.summarize(push.send, self._phase, self._step, now, self._timing)
                    next_beat = now + self._interval
                    self._parent.check()
                lease.guard()  # fenced: this process ends here
                wait_s = next_beat - time.monotonic()
                if (left := lease.LEASE.left_s()) is not None:
                    wait_s = min(wait_s, left + 0.01)  # wake when it runs out
                wait_ms = max(0.0, wait_s) * 1000
                ready = dict(poller.poll(wait_ms))
                if control is not None and control.socket in ready:
                    control.receive(zmq)
                if relay is not None and relay.socket in ready:
                    relay.forward(push.send, zmq)
                if self._wake_r in ready and not self._drain():
                    if relay is not None:
                        relay.finish(push.send, zmq, self._phase, self._step)
                    break
        finally:
            if relay is not None:
                relay.close()
            # Give the last messages (`done` above all) a bounded moment to leave.
            sock.close(linger=int(CLOSE_LINGER_S * 1000))
            if control is not None:
                control.close()
            ctx.term()
            os.close(self._wake_r)

    def _drain(self) -> bool:
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
            self._send(kind, t, **fields)

    def _send(self, kind: str, t: float, **fields: Any) -> None:
        """One of this rank's own messages (a relay folds it into its node's record first)."""
        if self._relay is not None:
            self._relay.core.own(kind, fields, time.monotonic())
        assert self._push is not None
        self._push.send(messages.encode(self._key, self._id.message(kind, t, **fields)))

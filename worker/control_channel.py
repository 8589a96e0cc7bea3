"""The supervisor's commands to one rank (faults/, a standby's go and exit), on the beacon's thread.

With `ES_CONTROL_ADDR` the beacon's thread also holds a DEALER socket to the supervisor's control
server and verifies every command on it (signed, for this job, attempt and rank). A `signal` is
carried out at once, by that thread (the rank signals itself), and so is a `lease` renewal
(worker.lease); `stall`, `slow` and the rest must happen inside a step, so they are queued for
the training loop (worker.step_commands); a standby's `go` and `exit` (and a prepared rank's
`become`) are queued for `wait_standby`, where the main thread blocks until one comes
(worker.standby, worker.prepared). The socket is the thread's alone (sockets are not
thread-safe); the queues are how the two threads meet.

The socket is a CURVE client with keys derived from the job's key (the supervisor admits no
other: contracts.control_msgs), on a routing id of this process's own
(`<attempt>/<rank>/<nonce>`); its one frame to the supervisor is the signed hello that claims
this rank's identity for that routing id, queued at once and sent when the handshake is done.
"""

from __future__ import annotations

import os
import queue
import secrets
import time
from collections.abc import Callable
from typing import Any

from contracts import control_msgs, messages, stack_files
from worker import lease, stack_dump

# A standby's wait looks at the stop flag this often: a signal handler cannot safely wake a
# thread blocked on a lock (it may interrupt the very code that holds it), so the wait is timed.
STOP_CHECK_S = 0.2


class ControlChannel:
    """One rank's end of the control channel: the socket (the beacon's thread opens, reads and
    closes it) and what it received for the main thread."""

    def __init__(self, addr: str, key: bytes, identity: messages.RankIdentity) -> None:
        self.addr = addr
        self._key = key
        self._id = identity
        self.socket: Any = None
        self.dropped = 0  # frames that failed verification
        self._in_step: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()  # stall, slow
        self._standby: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()  # go/exit/become

    # --- the beacon's thread -------------------------------------------------------------
    def open(self, ctx: Any, zmq: Any) -> Any:
        from zmq.utils import z85

        def public(secret: bytes) -> bytes:
            return z85.decode(zmq.curve_public(z85.encode(secret)))

        i = self._id
        conn = control_msgs.control_conn(i.attempt, i.rank, secrets.token_hex(8))
        client = control_msgs.curve_secret(self._key, control_msgs.CURVE_CLIENT)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, conn)
        sock.curve_serverkey = public(
            control_msgs.curve_secret(self._key, control_msgs.CURVE_SERVER)
        )
        sock.curve_publickey = public(client)
        sock.curve_secretkey = client
        sock.setsockopt(zmq.MAXMSGSIZE, 4 * messages.MAX_MESSAGE_BYTES)
        sock.connect(self.addr)
        hello = control_msgs.control_hello(i.job, i.attempt, i.rank, time.time(), conn)
        try:  # queued until the handshake is done
            sock.send(messages.encode(self._key, hello), zmq.NOBLOCK)
        except zmq.Again:
            pass  # refused already (not the supervisor's key): the supervisor says it unreached
        self.socket = sock
        return sock

    def receive(self, zmq: Any) -> None:
        """Verify each waiting command; signal at once, queue the others for the main thread."""
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            i = self._id
            try:
                cmd = control_msgs.decode_control(self._key, frame, i.job, i.attempt, i.rank)
            except messages.BadMessage:
                self.dropped += 1
                continue
            if cmd["action"] == "signal":
                if cmd["signal"] == stack_files.STACKS_SIGNAL and not stack_dump.installed():
                    continue  # its default action would end a process without the handler
                os.kill(os.getpid(), cmd["signal"])
            elif cmd["action"] == "lease":
                lease.LEASE.renew(cmd["until"], cmd["epoch"])
            elif cmd["action"] in control_msgs.STANDBY_ACTIONS:
                self._standby.put(cmd)
            else:
                self._in_step.put(cmd)

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)

    # --- the main thread -----------------------------------------------------------------
    def in_step_commands(self) -> list[dict[str, Any]]:
        """The commands for the training loop (stall, slow) received since the last call."""
        out = []
        while not self._in_step.empty():
            out.append(self._in_step.get_nowait())
        return out

    def wait_standby(self, stop_requested: Callable[[], bool]) -> dict[str, Any]:
        """Block until the supervisor says `go`, `exit` or `become` (the command), or a stop is
        requested (action "stop")."""
        while not stop_requested():
            try:
                return self._standby.get(timeout=STOP_CHECK_S)
            except queue.Empty:
                continue
        return {"action": "stop"}

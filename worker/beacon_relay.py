"""Local rank 0's beacon thread as its node's relay: the node-local socket around a `RelayCore`.

The core (worker.relay) folds frames and makes summaries without sockets; this binds the node's
socket, takes its frames in batches, forwards what must go on as it came, sends the node's
summary in place of the relay's own beat, and at the end waits briefly for the node's last
`done`s. Every send goes through the beacon's PUSH socket (`send`: it never waits, and counts
what it drops), on the beacon's one thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from contracts import messages
from worker.relay import RelayCore

RELAY_BATCH = 1000  # frames a relay forwards before it looks at its own beat again
RELAY_CLOSE_S = 0.5  # a closing relay waits this long at most for its node's last `done`s
RCV_HWM = 10 * 1024  # the node's frames queued here: ten beacon queues (worker.beat.QUEUE_SIZE)

Send = Callable[[bytes], None]


class NodeRelay:
    """A node's relay: `core` (its state) behind the socket bound at `addr`."""

    def __init__(self, core: RelayCore, addr: str) -> None:
        self.core = core
        self.addr = addr
        self.socket: Any = None

    def open(self, ctx: Any, zmq: Any) -> bool:
        """Bind the node's socket; False when its address is taken (this rank then beats
        alone)."""
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, messages.MAC_LEN + messages.MAX_MESSAGE_BYTES)
        try:
            sock.bind(self.addr)
        except zmq.ZMQError:
            sock.close(linger=0)
            return False
        path = self.addr.removeprefix("ipc://")
        if not path.startswith("@"):  # a socket file: this user's only
            try:
                os.chmod(path, 0o600)
            except OSError:
                pass
        self.socket = sock
        return True

    def summarize(
        self, send: Send, phase: str, step: int, now: float, timing: dict | None = None
    ) -> None:
        """The relay's beat (with its latest step's `timing`, if any): its own beat folded in,
        then the node's summary to the supervisor."""
        self.core.own("beat", {"phase": phase, "step": step, **(timing or {})}, now)
        frame = self.core.summary_frame(time.time(), now)
        if frame is not None:
            send(frame)

    def forward(self, send: Send, zmq: Any) -> None:
        """Fold the node's waiting frames; forward, in order, those that are not summarized."""
        take, now = self.core.take, time.monotonic()
        for _ in range(RELAY_BATCH):
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            out = take(frame, now)
            if out is not None:
                send(out)

    def finish(self, send: Send, zmq: Any, phase: str, step: int) -> None:
        """This rank is done: relay a short while longer, until the node's other ranks said
        `done` (they end together, and their last words go through here), then one last
        summary."""
        own = self.core.id.rank
        end = time.monotonic() + RELAY_CLOSE_S
        while time.monotonic() < end:
            ranks = self.core.ranks
            if all(r.phase == "done" for k, r in ranks.items() if k != own):
                break
            if self.socket.poll(int(1000 * max(0.0, end - time.monotonic()))):
                self.forward(send, zmq)
        self.summarize(send, phase, step, time.monotonic())

    def close(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)

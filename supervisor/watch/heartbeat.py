"""The supervisor's end of the heartbeat channel: one PULL socket, and who may connect to it.

`HeartbeatServer` binds the socket, verifies each message (size, HMAC, schema, job; never
unpickles), drops and counts bad ones, and hands good ones on (to the rank table:
supervisor.watch.rank_table). While messages come it drains the socket on a short timer (every
10 ms) rather than at each one: with thousands of ranks at 1 Hz that is one event-loop wake-up
per batch rather than one per message, and a beat waits at most a few milliseconds against
intervals of a second. A drain that found nothing waits for the socket instead: a small job's
few messages a second wake the supervisor a few times a second, not a hundred (that timer was
half of its CPU beside a 2-rank job).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from contracts import messages

# Messages queued per connection (each rank has its own): a rank sends a few a second, so 100
# is seconds of slack, and a flooding peer can make us hold at most 100 frames of
# MAX_MESSAGE_BYTES; past that ZeroMQ stops reading its socket (TCP pushes back on the sender).
RCV_HWM = 100
BATCH = 5_000  # messages handled before yielding to the event loop
DRAIN_EVERY_S = 0.01
# Under load (a drain found BUSY_BATCH or more), wait longer between drains: the wake-up and
# the loop's turn cost as much as several messages, and a relayed job of 1,000 nodes sends
# 1,000 summaries a second. Light jobs keep the short wait (their events stay prompt).
BUSY_BATCH = 8
DRAIN_BUSY_EVERY_S = 0.05


class HeartbeatServer:
    """Binds `tcp://bind:port` and serves until closed; `address` is what ranks connect to."""

    def __init__(
        self,
        key: bytes,
        job: str,
        bind: str = "127.0.0.1",
        port: int = 0,
        advertise: str | None = None,
        allow: Sequence[str] = (),
    ) -> None:
        self.key = key
        self.job = job
        self.dropped: Counter[str] = Counter()
        self.received = 0
        self._ctx = zmq.Context()
        self._auth = None
        self._sock = self._ctx.socket(zmq.PULL)
        if allow:  # only these addresses may connect at all (ZeroMQ's ZAP, before any frame)
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.allow(*allow)
            self._sock.zap_domain = b"elastic-supervisor"
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        # A peer sending a bigger frame than any message can be is dropped by ZeroMQ itself.
        self._sock.setsockopt(zmq.MAXMSGSIZE, messages.MAC_LEN + messages.MAX_MESSAGE_BYTES)
        if port:
            self._sock.bind(f"tcp://{bind}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{bind}")
        self.port = port
        host = advertise or ("127.0.0.1" if bind in ("0.0.0.0", "*") else bind)
        self.address = f"tcp://{host}:{port}"

    async def serve(self, handle: Callable[[dict[str, Any], float], None]) -> None:
        """Call `handle(message, monotonic_now)` for every good message, forever."""
        while True:
            n = self.drain(handle)
            if n == 0:
                await self._readable()
            else:
                await asyncio.sleep(DRAIN_BUSY_EVERY_S if n >= BUSY_BATCH else DRAIN_EVERY_S)

    async def _readable(self) -> None:
        """Until a message waits. The socket's descriptor is watched only during this wait: a
        watch left on the loop would wake it at every message of a busy socket, batching timer
        or not. ZeroMQ's descriptor signals edges, so its events are read first (which also
        re-arms it): a message that came since the drain is seen without a wake-up."""
        loop = asyncio.get_running_loop()
        fd = self._sock.getsockopt(zmq.FD)
        while not self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            woken = loop.create_future()
            loop.add_reader(fd, _wake, woken)
            try:
                await woken
            finally:
                loop.remove_reader(fd)

    def drain(self, handle: Callable[[dict[str, Any], float], None]) -> int:
        """Handle up to BATCH waiting messages without blocking; return how many."""
        n = 0
        recv = self._sock.recv  # one frame per message (see messages.encode)
        key, job = self.key, self.job
        now = time.monotonic()  # one clock read per batch: they arrived within milliseconds
        while n < BATCH:
            try:
                frame = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                message = messages.decode(key, frame, job)
            except messages.BadMessage as exc:
                self.dropped[exc.reason] += 1
                continue
            self.received += 1
            handle(message, now)
        return n

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


def _wake(woken: asyncio.Future) -> None:
    if not woken.done():
        woken.set_result(None)


def node_addresses(nodes: Sequence[str]) -> list[str]:
    """Every address the job's nodes (and this host's loopback) may connect from."""
    found = {"127.0.0.1", "::1"}
    for node in nodes:
        try:
            infos = socket.getaddrinfo(node, None, proto=socket.IPPROTO_TCP)
        except (socket.gaierror, UnicodeError):
            continue  # preflight refused a node that does not resolve; this one vanished since
        found.update(str(info[4][0]) for info in infos)
    return sorted(found)

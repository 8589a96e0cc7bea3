"""The supervisor's end of the heartbeat channel: one PULL socket and a table of ranks.

`HeartbeatServer` binds the socket, verifies each message (size, HMAC, schema, job; never
unpickles), drops and counts bad ones, and hands good ones on. It drains the socket on a short
timer (every 10 ms) instead of waking on its file descriptor: with thousands of ranks at 1 Hz
that is one event-loop wake-up per batch rather than one per message, and a beat waits at
most a few milliseconds against intervals of a second.

`AttemptTable` turns one attempt's messages into rank states for `decisions.judge_ranks` and
into the few notes worth an event (hello, first step, checkpoint complete, resumed, error, done).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from supervisor import protocol
from supervisor.decisions import RankState

# Messages queued per connection (each rank has its own): a rank sends a few a second, so 100
# is seconds of slack, and a flooding peer can make us hold at most 100 frames of
# MAX_MESSAGE_BYTES; past that ZeroMQ stops reading its socket (TCP pushes back on the sender).
RCV_HWM = 100
BATCH = 5_000  # messages handled before yielding to the event loop
DRAIN_EVERY_S = 0.01


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
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAC_LEN + protocol.MAX_MESSAGE_BYTES)
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
            self.drain(handle)
            await asyncio.sleep(DRAIN_EVERY_S)

    def drain(self, handle: Callable[[dict[str, Any], float], None]) -> int:
        """Handle up to BATCH waiting messages without blocking; return how many."""
        n = 0
        recv = self._sock.recv  # one frame per message (see protocol.encode)
        key, job = self.key, self.job
        now = time.monotonic()  # one clock read per batch: they arrived within milliseconds
        while n < BATCH:
            try:
                frame = recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            try:
                message = protocol.decode(key, frame, job)
            except protocol.BadMessage as exc:
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


@dataclass
class Note:
    """Something an attempt's messages revealed that is worth one event."""

    event: str
    fields: dict[str, Any]


@dataclass
class AttemptTable:
    """Rank states of one attempt, and what its ranks have said so far."""

    attempt: int
    world: int
    launched_at: float
    ranks: dict[int, RankState] = field(default_factory=dict)
    first_step: int | None = None
    max_step: int | None = None
    resume_step: int | None = None
    resume_source: str | None = None  # memory | durable, when the ranks say (a memory tier)
    restart_seconds: float | None = None
    done_ranks: set[int] = field(default_factory=set)
    ckpt_complete: int | None = None
    errors: dict[int, str] = field(default_factory=dict)
    stale: int = 0

    def update(self, msg: dict[str, Any], now: float) -> list[Note]:
        """Fold one verified message into the table; return the notes it produced."""
        if msg["attempt"] != self.attempt:
            self.stale += 1  # a straggler of an earlier attempt
            return []
        rank = msg["rank"]
        if not 0 <= rank < self.world or msg["world"] != self.world:
            self.stale += 1
            return []
        kind = msg["kind"]
        st = self.ranks.get(rank)
        notes: list[Note] = []
        if st is None:
            st = RankState(rank=rank, last_seen=now, last_progress=now)
            self.ranks[rank] = st
        st.last_seen = now
        if kind == "beat":
            self._move(st, msg["phase"], msg["step"], now)
        elif kind == "step":
            step = msg["step"]
            self._move(st, st.phase, step, now)
            if self.first_step is None:
                self.first_step = step
                notes.append(Note("first_step", {"rank": rank, "step": step, "t": msg["t"]}))
            if self.max_step is None or step > self.max_step:
                self.max_step = step
        elif kind == "phase":
            old = st.phase
            self._move(st, msg["phase"], msg["step"], now)
            if rank == 0 and old != msg["phase"]:
                notes.append(Note("phase", {"phase": msg["phase"], "step": msg["step"]}))
        elif kind == "hello":
            st.host, st.pid = msg["host"], msg["pid"]
            self._move(st, msg["phase"], st.step, now)
            notes.append(
                Note(
                    "rank_hello",
                    {"rank": rank, "host": st.host, "pid": st.pid, "phase": msg["phase"]},
                )
            )
        elif kind == "ckpt":
            if msg["state"] == "complete" and (
                self.ckpt_complete is None or msg["step"] > self.ckpt_complete
            ):
                self.ckpt_complete = msg["step"]
                notes.append(Note("ckpt_complete", {"step": msg["step"], "rank": rank}))
        elif kind == "resumed":
            if self.resume_step is None:
                self.resume_step = msg["step"]
                self.resume_source = msg.get("source")
                self.restart_seconds = msg["restart_seconds"]
                said = {
                    "step": msg["step"],
                    "restart_seconds": msg["restart_seconds"],
                    "rank": rank,
                }
                if self.resume_source is not None:
                    said["source"] = self.resume_source
                notes.append(Note("resumed", said))
        elif kind == "error":
            self.errors[rank] = msg["message"]
            notes.append(Note("rank_error", {"rank": rank, "message": msg["message"]}))
        elif kind == "done":
            self._move(st, "done", msg["step"], now)
            first = not self.done_ranks
            self.done_ranks.add(rank)
            if first:
                notes.append(Note("rank_done", {"rank": rank, "step": msg["step"]}))
        return notes

    @staticmethod
    def _move(st: RankState, phase: str, step: int, now: float) -> None:
        if phase != st.phase or step != st.step:
            st.phase, st.step, st.last_progress = phase, step, now

    @property
    def stepped(self) -> bool:
        return self.first_step is not None

    def effective_resume_step(self) -> int | None:
        """Where this attempt started: its `resumed` step, 0 if it stepped without one."""
        if self.resume_step is not None:
            return self.resume_step
        return 0 if self.stepped else None

    def local_pids(self, host: str) -> list[int]:
        return [st.pid for st in self.ranks.values() if st.pid and st.host == host]

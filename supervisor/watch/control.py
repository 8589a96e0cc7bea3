"""The supervisor's end of the control channel: signed commands to single ranks.

One ROUTER socket that each rank's beat thread connects a DEALER to. The faults use it for
`signal`/`stall`/`slow`, the standby for `go`/`exit`. Sends never block; a rank not connected yet
is reported, not waited for.

Only a peer that proves the job's key is sent anything: the socket is a ZeroMQ CURVE server whose
keys, and the one client key it admits (ZAP, on a thread of its own), are derived from the job's
key (contracts.control_msgs). Each admitted peer claims its `<attempt>/<rank>` in a signed hello on
a routing id of its own; the claims are judged by supervisor.policy.control_claims, and a rank's
commands go to the routing id that owns its identity, never to one that merely bears its name.
"""

from __future__ import annotations

import errno
from collections import Counter
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from contracts import control_msgs, messages
from supervisor.policy import control_claims

NOT_CONNECTED = "rank not connected to the control channel"
ZAP_DOMAIN = "elastic-supervisor-control"
KEY = "key"  # a refusal's reason: a CURVE client key other than the job's
# Hellos queued per connection: a rank sends one; a peer that sends more waits (TCP pushes back).
RCV_HWM = 16
# A connection that has not finished its handshake by then is closed: a peer that opens many and
# says nothing holds no descriptors for long (a rank's takes milliseconds).
HANDSHAKE_S = 10
MAX_FRAME = 1024
HELLOS_PER_DRAIN = 10_000  # a drain yields to the event loop after this many


def curve_public(secret: bytes) -> bytes:
    """The public half (32 bytes) of a CURVE secret key."""
    return z85.decode(zmq.curve_public(z85.encode(secret)))


class _JobKeyOnly:
    """The ZAP handler's judge (its thread calls `callback`): only the job's client key."""

    def __init__(self, client_public: bytes) -> None:
        self._allowed = z85.encode(client_public)
        self.refused = 0  # written by the ZAP thread only

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self._allowed:
            return True
        self.refused += 1
        return False


class ControlServer:
    """The supervisor's end of the control channel."""

    def __init__(self, key: bytes, job: str, bind: str, advertise: str) -> None:
        if not zmq.has("curve"):
            raise RuntimeError(
                "this pyzmq has no CURVE (libsodium): the control channel admits only peers "
                "that prove the job's key; install a pyzmq wheel (they carry it)"
            )
        self.key, self.job = key, job
        self.refused: Counter[str] = Counter()  # refused hellos by reason (see refusals())
        self.last_refused = ""  # the newest refused claim, said in `control_refused`
        self._owners: dict[int, dict[int, bytes]] = {}  # attempt -> rank -> owning routing id
        self._ended: set[int] = set()  # attempts forgotten: their identities are claimed no more
        self._fenced: set[int] = set()  # attempts whose leases are renewed no more
        self.epoch = 0  # lease renewals so far (each round's number)
        self._ctx = zmq.Context()
        self._judge = _JobKeyOnly(
            curve_public(control_msgs.curve_secret(key, control_msgs.CURVE_CLIENT))
        )
        self._auth = ThreadAuthenticator(self._ctx)
        self._auth.start()
        self._auth.configure_curve_callback(ZAP_DOMAIN, self._judge)
        sock = self._sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_server = True
        sock.curve_secretkey = control_msgs.curve_secret(key, control_msgs.CURVE_SERVER)
        sock.zap_domain = ZAP_DOMAIN.encode()
        # Unknown routing id -> EHOSTUNREACH instead of a silent drop: we learn of it.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A rank's DEALER that reconnects (a dropped link) keeps its routing id: its new
        # connection takes over the old one the ROUTER may not have seen end. Only peers with the
        # key connect at all, and each routing id holds a nonce of its process's own.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # Ranks send one hello on it: cap what a peer could make us buffer (the handshake's
        # frames pass this check too, hence more than a hello).
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_S * 1000)
        port = sock.bind_to_random_port(f"tcp://{bind}")
        self.address = f"tcp://{advertise}:{port}"

    def drain(self) -> int:
        """Take the hellos waiting now (never blocks): each binds, or is refused and counted."""
        n = 0
        while n < HELLOS_PER_DRAIN:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            n += 1
            if len(frames) != 2:
                self._refuse("frames", f"{len(frames)} frames from {frames[0]!r}")
                continue
            sender, frame = frames
            try:
                hello = control_msgs.decode_hello(self.key, frame, self.job)
            except messages.BadMessage as exc:
                self._refuse(exc.reason, f"a hello from {sender!r}: {exc}")
                continue
            claim = control_claims.Claim(hello["attempt"], hello["rank"], hello["conn"], sender)
            ranks = self._owners.get(claim.attempt, {})
            verdict = control_claims.judge(
                claim, ranks.get(claim.rank), claim.attempt in self._ended
            )
            if verdict.refused is not None:
                what = f"{claim.attempt}/{claim.rank} claimed by {sender!r}"
                self._refuse(verdict.refused, f"{what}: {verdict.refused}")
            elif verdict.owner is not None:
                self._owners.setdefault(claim.attempt, {})[claim.rank] = verdict.owner
        return n

    def _refuse(self, reason: str, what: str) -> None:
        self.refused[reason] += 1
        self.last_refused = what[:200]

    def refusals(self) -> Counter[str]:
        """Every refusal so far by reason: hellos, and `key` (handshakes with another key)."""
        out = Counter(self.refused)
        if self._judge.refused:
            out[KEY] = self._judge.refused
        return out

    def owner(self, attempt: int, rank: int) -> bytes | None:
        """The routing id that owns `attempt/rank` (after the hellos waiting now), or None."""
        self.drain()
        return self._owners.get(attempt, {}).get(rank)

    def forget(self, attempt: int) -> None:
        """An attempt's processes have ended: let its identities go, and take no claim of them
        again (keeps the table to the attempts alive)."""
        self._owners.pop(attempt, None)
        self._ended.add(attempt)
        self._fenced.discard(attempt)

    def fence(self, attempt: int) -> None:
        """Renew `attempt`'s leases no more: its ranks stop within one lease (worker.lease),
        reached or not."""
        self._fenced.add(attempt)

    def renew(self, until: float, t: float) -> int:
        """One round of leases, until wall time `until`: to every rank that owns an identity of
        an attempt neither fenced nor forgotten. Returns how many were sent."""
        self.drain()
        self.epoch += 1
        sent = 0
        for attempt, ranks in list(self._owners.items()):
            if attempt in self._fenced or attempt in self._ended:
                continue
            for rank, conn in list(ranks.items()):  # drained once above, not once a rank
                message = control_msgs.control_message(
                    self.job, attempt, rank, t, "lease", 0, until=until, epoch=self.epoch
                )
                sent += self._send_to(conn, message) is None
        return sent

    def send(self, attempt: int, rank: int, message: dict[str, Any]) -> str | None:
        """Queue one command for a rank; None when sent, else why not."""
        conn = self.owner(attempt, rank)
        if conn is None:
            return NOT_CONNECTED
        return self._send_to(conn, message)

    def _send_to(self, conn: bytes, message: dict[str, Any]) -> str | None:
        frame = messages.encode(self.key, message)
        try:
            self._sock.send_multipart([conn, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:
                return NOT_CONNECTED
            return f"control send failed: {exc}"
        return None

    def close(self) -> None:
        self._sock.close(linger=0)
        self._auth.stop()
        self._ctx.term()

    def command(
        self, attempt: int, rank: int, action: str, t: float, env: dict[str, str] | None = None
    ) -> str | None:
        """A `go`, `exit` or `become` (with the rank's `env`) to one rank."""
        message = control_msgs.control_message(self.job, attempt, rank, t, action, 0, env=env)
        return self.send(attempt, rank, message)


def bind_for(heartbeat_address: str) -> tuple[str, str]:
    """(bind, advertise) of the control socket: where the heartbeat server is reached."""
    host = heartbeat_address.removeprefix("tcp://").rsplit(":", 1)[0]
    return ("127.0.0.1" if host in ("127.0.0.1", "localhost") else "0.0.0.0"), host

"""A keyless process that claims ranks' identities on a control channel (the tests' intruder).

`python -m tests.e2e.control_intruder ADDR [SERVER_PUBLIC_HEX]`, then lines on stdin:
`claim A R [EVERY_S]` starts knocking as rank R of attempt A and says `claimed` once its first
sockets have had a moment to connect; `report` stops it and says `got N` (the frames all of its
sockets received); end of input ends it. It never holds the job's key. Its ways in, each opened
anew every EVERY_S (10 ms; a refused handshake ends a socket's connection for good) and kept
HOLD_S:

- a plain DEALER (no CURVE) on routing id `A/R` (the identity as such), sending a hello signed
  with a key of its own;
- the same on the routing id a rank's would have, `A/R/<nonce>`;
- a CURVE DEALER with keys of its own and a guess at the server's key;
- with SERVER_PUBLIC_HEX (the server's public key, as if it leaked): a CURVE DEALER that finishes
  the server's half of the handshake, with a client key of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from contracts import control_msgs, messages

RECONNECT_MS = 10
KNOCK_S = 0.01  # a new set of sockets this often (unless `claim` says), while the rank connects
HOLD_S = 0.5  # each set is kept this long, then closed (what it received counted)
SETTLE_S = 0.03  # after the first set: its handshakes have been tried before the rank's


def sockets_for(
    ctx: zmq.Context, addr: str, attempt: int, rank: int, server: bytes | None
) -> list[zmq.Socket]:
    forged = os.urandom(32)
    ids = [
        f"{attempt}/{rank}".encode(),
        control_msgs.control_conn(attempt, rank, "0" * 16),
        control_msgs.control_conn(attempt, rank, "1" * 16),
    ]
    if server is not None:
        ids.append(control_msgs.control_conn(attempt, rank, "2" * 16))
    out = []
    for n, conn in enumerate(ids):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        s.setsockopt(zmq.ROUTING_ID, conn)
        if n >= 2:  # CURVE, with keys of its own
            public, secret = zmq.curve_keypair()
            s.curve_publickey, s.curve_secretkey = public, secret
            s.curve_serverkey = zmq.curve_keypair()[0] if n == 2 else server
        s.connect(addr)
        hello = control_msgs.control_hello("job", attempt, rank, time.time(), conn)
        try:
            s.send(messages.encode(forged, hello), zmq.NOBLOCK)
        except zmq.Again:
            pass  # refused already: its connection is gone
        out.append(s)
    return out


def drained(socks: list[zmq.Socket]) -> int:
    """Close `socks`; the frames they had received."""
    got = 0
    for s in socks:
        while s.poll(0):
            s.recv_multipart()
            got += 1
        s.close(0)
    return got


class Knocker(threading.Thread):
    """Opens a new set of sockets for one identity every `every_s` until stopped, each set kept
    HOLD_S (what it received counted, then closed); the rest are the main thread's once it has
    joined."""

    def __init__(self, ctx: zmq.Context, addr: str, attempt: int, rank: int, server, every_s):
        super().__init__(daemon=True)
        self.args = (ctx, addr, attempt, rank, server)
        self.every_s = every_s
        self.held: list[tuple[float, list[zmq.Socket]]] = []
        self.got = 0
        self.first = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.monotonic()
            self.held.append((now, sockets_for(*self.args)))
            while now - self.held[0][0] > HOLD_S:
                self.got += drained(self.held.pop(0)[1])
            self.first.set()
            self.stop.wait(self.every_s)

    def end(self) -> int:
        """Stop; every frame its sockets received."""
        self.stop.set()
        self.join()
        return self.got + sum(drained(socks) for _, socks in self.held)


def start(addr: str, server_public: bytes | None = None) -> subprocess.Popen:
    """The intruder, on the control socket at `addr` (with the server's public key, as leaked)."""
    leaked = [server_public.hex()] if server_public is not None else []
    return subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.control_intruder", addr, *leaked],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip


def ask(proc: subprocess.Popen, line: str) -> str:
    """One line to the intruder, and its answer."""
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(10)


def main() -> int:
    addr = sys.argv[1]
    server = None
    if len(sys.argv) > 2:
        from zmq.utils import z85

        server = z85.encode(bytes.fromhex(sys.argv[2]))
    ctx = zmq.Context()
    knockers: list[Knocker] = []
    for line in sys.stdin:
        word = line.split()
        if word[:1] == ["claim"]:
            every = float(word[3]) if len(word) > 3 else KNOCK_S
            knocker = Knocker(ctx, addr, int(word[1]), int(word[2]), server, every)
            knocker.start()
            knocker.first.wait()
            knockers.append(knocker)
            time.sleep(SETTLE_S)
            print("claimed", flush=True)
        elif word[:1] == ["report"]:
            got = sum(knocker.end() for knocker in knockers)
            knockers = []
            print(f"got {got}", flush=True)
    for knocker in knockers:
        knocker.end()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())

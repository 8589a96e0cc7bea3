"""A keyless process that claims ranks' identities on a control channel (the tests' intruder).

`python -m tests.e2e.control_intruder ADDR [SERVER_PUBLIC_HEX]`, then lines on stdin:
`claim A R` starts knocking as rank R of attempt A and says `claimed` once its first sockets have
had a moment to connect; `report` stops it and says `got N` (the frames all of its sockets
received) and closes them; end of input ends it. It never holds the job's key. Its ways in, each
opened anew every 10 ms (a refused handshake ends a socket's connection for good):

- a plain DEALER (no CURVE) on routing id `A/R` (the identity as such), sending a hello signed
  with a key of its own;
- the same on the routing id a rank's would have, `A/R/<nonce>`;
- a CURVE DEALER with keys of its own and a guess at the server's key;
- with SERVER_PUBLIC_HEX (the server's public key, as if it leaked): a CURVE DEALER that finishes
  the server's half of the handshake, with a client key of its own.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import zmq

from contracts import control_msgs, messages

RECONNECT_MS = 10
KNOCK_S = 0.01  # a new set of sockets this often, while the real rank connects
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


class Knocker(threading.Thread):
    """Opens a new set of sockets for one identity every KNOCK_S until stopped; they are the
    main thread's once it has joined."""

    def __init__(self, ctx: zmq.Context, addr: str, attempt: int, rank: int, server) -> None:
        super().__init__(daemon=True)
        self.args = (ctx, addr, attempt, rank, server)
        self.held: list[zmq.Socket] = []
        self.first = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.held += sockets_for(*self.args)
            self.first.set()
            self.stop.wait(KNOCK_S)


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
            knocker = Knocker(ctx, addr, int(word[1]), int(word[2]), server)
            knocker.start()
            knocker.first.wait()
            knockers.append(knocker)
            time.sleep(SETTLE_S)
            print("claimed", flush=True)
        elif word[:1] == ["report"]:
            got = 0
            for knocker in knockers:
                knocker.stop.set()
                knocker.join()
                for s in knocker.held:
                    while s.poll(0):
                        s.recv_multipart()
                        got += 1
                    s.close(0)
            knockers = []
            print(f"got {got}", flush=True)
    for knocker in knockers:
        knocker.stop.set()
        knocker.join()
        for s in knocker.held:
            s.close(0)
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())

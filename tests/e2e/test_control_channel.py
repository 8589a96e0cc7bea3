"""The control channel admits only a peer that proves the job's key, and a rank's identity is its
first claimant's: the supervisor's real socket (`ControlServer`), the ranks' real ends
(`worker.control_channel`) and a real keyless intruder process (tests/e2e/control_intruder.py).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time

import zmq

from contracts import control_msgs, messages
from supervisor.run import services
from supervisor.settings.config import HeartbeatConfig
from supervisor.watch.control import ControlServer, curve_public
from tests.e2e import control_intruder
from worker.control_channel import ControlChannel

TRIES = 100
BOUND_S = 5.0  # a rank connects, finishes its handshake and says its hello well within this


def rank_end(server: ControlServer, key: bytes, attempt: int, rank: int = 0) -> ControlChannel:
    ident = messages.RankIdentity("job", attempt, rank, 1, "h", os.getpid())
    return ControlChannel(server.address, key, ident)


def send_when_bound(server: ControlServer, attempt: int, rank: int, action: str) -> None:
    """A command, retried while the rank is not yet connected (as the fault engine retries)."""
    deadline = time.monotonic() + BOUND_S
    while (err := server.command(attempt, rank, action, time.time())) is not None:
        assert time.monotonic() < deadline, err
        time.sleep(0.001)


def received(channel: ControlChannel, want: int, wait_s: float = BOUND_S) -> list[str]:
    """The actions the rank's end takes in, until `want` of them (or `wait_s`)."""
    got: list[dict] = []
    deadline = time.monotonic() + wait_s
    while len(got) < want and time.monotonic() < deadline:
        channel.socket.poll(50)
        channel.receive(zmq)
        got += channel.in_step_commands()
        while not channel._standby.empty():
            got.append(channel._standby.get_nowait())
    return [c["action"] for c in got]


def test_a_keyless_intruder_neither_gets_nor_loses_a_ranks_command():
    """Issue 38's figure: for each of 100 identities the intruder connects first, on every way
    it has (the plain routing id, a rank's form of it, CURVE with a guessed server key, and with
    the server's public key as if leaked), and keeps knocking while the real rank connects; the
    rank then gets its `stall` and its `go`, and the intruder gets nothing."""
    key = secrets.token_hex(32).encode()
    server = ControlServer(key, "job", "127.0.0.1", "127.0.0.1")
    leaked = curve_public(control_msgs.curve_secret(key, control_msgs.CURVE_SERVER))
    intruder = control_intruder.start(server.address, leaked)
    ctx = zmq.Context()
    delivered, stolen = 0, 0
    try:
        for attempt in range(TRIES):
            assert control_intruder.ask(intruder, f"claim {attempt} 0") == "claimed"
            rank = rank_end(server, key, attempt)
            sock = rank.open(ctx, zmq)
            try:
                send_when_bound(server, attempt, 0, "stall")
                send_when_bound(server, attempt, 0, "go")
                got = received(rank, 2)
                assert server.owner(attempt, 0) == sock.getsockopt(zmq.ROUTING_ID)
            finally:
                rank.close()
            delivered += got == ["stall", "go"]
            stolen += int(control_intruder.ask(intruder, "report").removeprefix("got "))
            server.forget(attempt)
    finally:
        control_intruder.stop(intruder)
        ctx.term()
        server.close()
    print(f"the real rank got every command in {delivered} of {TRIES} tries; intruder: {stolen}")
    assert (delivered, stolen) == (TRIES, 0)
    refusals = server.refusals()
    # Only the leaked-key sockets got as far as a client key; the others failed the handshake.
    assert refusals["key"] >= TRIES and set(refusals) == {"key"}, refusals


def test_a_second_claimant_with_the_key_is_refused_and_said():
    """A second process with the key that claims a rank's identity gets none of its commands:
    refused, counted, and said in a `control_refused` event."""
    key = secrets.token_hex(32).encode()
    server = ControlServer(key, "job", "127.0.0.1", "127.0.0.1")
    ctx = zmq.Context()
    first, second = rank_end(server, key, 7, 1), rank_end(server, key, 7, 1)
    events: list[dict] = []

    async def serve_a_moment() -> None:
        task = asyncio.create_task(
            services.serve_control(
                server, HeartbeatConfig(), lambda e, **kw: events.append({"event": e, **kw})
            )
        )
        await asyncio.sleep(0.5)
        task.cancel()

    try:
        mine = first.open(ctx, zmq).getsockopt(zmq.ROUTING_ID)
        send_when_bound(server, 7, 1, "go")
        second.open(ctx, zmq)
        asyncio.run(serve_a_moment())
        send_when_bound(server, 7, 1, "exit")
        assert received(first, 2) == ["go", "exit"]
        assert received(second, 1, wait_s=0.3) == []
        assert server.owner(7, 1) == mine
        # An ended attempt's identity is claimed by nobody, even its first claimant again.
        server.forget(7)
        third = rank_end(server, key, 7, 1)
        third.open(ctx, zmq)
        deadline = time.monotonic() + BOUND_S
        while server.refusals()["ended"] < 1 and time.monotonic() < deadline:
            assert server.owner(7, 1) is None  # takes the hellos waiting
            time.sleep(0.01)
        third.close()
    finally:
        first.close()
        second.close()
        ctx.term()
        server.close()
    assert server.refusals() == {"claimed": 1, "ended": 1}
    (said,) = [e for e in events if e["event"] == "control_refused"]
    assert said["total"] == said["new"] == 1 and said["by_reason"] == {"claimed": 1}
    assert said["last"].startswith("7/1 claimed by b'7/1/")

"""Heartbeats over real ZeroMQ sockets: the beacon, the server, and what it refuses."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

import zmq

from contracts import env_names, messages
from supervisor.watch.heartbeat import HeartbeatServer
from supervisor.watch.rank_table import AttemptTable
from tests.support import BEACON_JOB as JOB
from tests.support import BEACON_KEY as KEY
from tests.support import beacon_env
from worker.beat import Beacon, ZmqBeacon


async def collect(server, until, timeout=10.0):
    """Serve until `until(messages)` holds (bounded by timeout); return the messages."""
    got: list[dict] = []
    task = asyncio.create_task(server.serve(lambda m, now: got.append(m)))
    deadline = time.monotonic() + timeout
    try:
        while not until(got) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
    return got


@contextlib.contextmanager
def pushing_to(server):
    """A rank's PUSH socket connected to `server` (no linger), closed with its context after."""
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(server.address)
    try:
        yield push
    finally:
        push.close()
        ctx.term()


RANK0 = messages.RankIdentity(JOB, 0, 0, 1, "h", 1)


def test_no_address_means_a_silent_beacon(monkeypatch):
    monkeypatch.delenv(env_names.ENV_HEARTBEAT_ADDR, raising=False)
    b = Beacon.from_env(0, 1)
    assert type(b) is Beacon
    b.hello("init")
    b.step(1, 1.0, 0.1)
    b.close()


def test_beacon_to_server_in_order_with_beats(monkeypatch):
    async def main():
        server = HeartbeatServer(KEY.encode(), JOB)
        beacon_env(monkeypatch, server.address)
        b = Beacon.from_env(1, 2)
        assert isinstance(b, ZmqBeacon)
        b.hello("init")
        b.phase("load", 0)
        b.resumed(10, 2.5)
        b.phase("train", 10)
        b.step(11, 3.25, 0.05)
        b.ckpt(12, "memory")
        b.ckpt(13, "memory")  # within the interval of the one before: not sent
        b.ckpt(15, "complete")
        b.error("boom")
        b.done(20)

        def enough(got):
            return (
                any(m["kind"] == "done" for m in got) and sum(m["kind"] == "beat" for m in got) >= 3
            )

        got = await collect(server, enough)
        b.close()
        server.close()
        return got

    got = asyncio.run(main())
    kinds = [m["kind"] for m in got if m["kind"] != "beat"]
    assert kinds == ["hello", "phase", "resumed", "phase", "step", "ckpt", "ckpt", "error", "done"]
    ckpts = [(m["step"], m["state"]) for m in got if m["kind"] == "ckpt"]
    assert ckpts == [(12, "memory"), (15, "complete")]
    step = next(m for m in got if m["kind"] == "step")
    assert step["rank"] == 1 and step["world"] == 2 and step["pid"] == os.getpid()
    assert step["loss"] == 3.25 and step["job"] == JOB
    beats = [m for m in got if m["kind"] == "beat"]
    assert beats[-1]["phase"] == "done" and beats[-1]["step"] == 20


def test_bad_messages_dropped_counted_and_server_keeps_working(monkeypatch):
    async def main():
        server = HeartbeatServer(KEY.encode(), JOB)
        # Oversized: ZeroMQ itself refuses it (MAXMSGSIZE) and cuts that peer off, before
        # a byte of it is queued for us; sent from a socket of its own.
        with pushing_to(server) as push, pushing_to(server) as big_sender:
            good = RANK0.message("beat", time.time(), phase="train", step=1)
            body = json.dumps(good).encode()
            push.send(body)  # unsigned
            push.send(messages.sign(b"wrong key", body) + body)  # wrongly signed
            bad_json = b'{"v": 1, "kind":'
            push.send(messages.sign(KEY.encode(), bad_json) + bad_json)  # malformed
            big = json.dumps({**good, "pad": "x" * (messages.MAX_MESSAGE_BYTES + 10)}).encode()
            big_sender.send(messages.sign(KEY.encode(), big) + big)
            push.send(b"short")  # not even a signature's length
            other = messages.RankIdentity("other-job", 0, 0, 1, "h", 1).message(
                "beat", time.time(), phase="train", step=1
            )
            push.send(messages.encode(KEY.encode(), other))  # replayed from another job
            push.send(messages.encode(b"other job key", other))  # another job's own key
            push.send(messages.encode(KEY.encode(), good))  # and one good one
            got = await collect(server, lambda g: len(g) >= 1 and sum(server.dropped.values()) >= 6)
            await asyncio.sleep(0.2)  # had the oversized frame got through, it would be counted
            server.drain(lambda m, now: got.append(m))
        server.close()
        return got, dict(server.dropped)

    got, dropped = asyncio.run(main())
    assert [m["kind"] for m in got] == ["beat"]
    # The unsigned body is long enough to hold a "signature": it fails the check.
    assert dropped == {"frames": 1, "signature": 3, "json": 1, "other_job": 1}


def test_sends_never_block_without_a_receiver(monkeypatch):
    beacon_env(monkeypatch, "tcp://127.0.0.1:9")  # nobody listens there
    b = Beacon.from_env(0, 1)
    t0 = time.monotonic()
    for i in range(20_000):
        b.step(i, 1.0, 0.01)
    spent = time.monotonic() - t0
    t1 = time.monotonic()
    b.close()
    assert spent < 2.0, f"20k sends took {spent:.2f} s"
    assert time.monotonic() - t1 < 2.0
    assert b.dropped > 0


def test_attempt_table_notes_and_stale_messages():
    t = AttemptTable(attempt=1, world=2, launched_at=0.0)
    ident = messages.RankIdentity(JOB, 1, 0, 2, "h", 7)
    m = ident.message
    assert [n.event for n in t.update(m("hello", 1.0, phase="init"), 1.0)] == ["rank_hello"]
    assert t.update(m("phase", 1.0, phase="train", step=10), 2.0)[0].event == "phase"
    assert t.update(m("resumed", 1.0, step=10, restart_seconds=3.0), 2.0)[0].event == "resumed"
    assert t.update(m("step", 1.0, step=11, loss=1.0, dt=0.1), 3.0)[0].event == "first_step"
    assert t.update(m("step", 1.0, step=12, loss=1.0, dt=0.1), 4.0) == []
    assert t.ranks[0].step == 12 and t.ranks[0].last_progress == 4.0
    t.update(m("beat", 1.0, phase="train", step=12), 9.0)
    assert t.ranks[0].last_seen == 9.0 and t.ranks[0].last_progress == 4.0
    assert t.update(m("ckpt", 1.0, step=15, state="complete"), 10.0)[0].event == "ckpt_complete"
    old = messages.RankIdentity(JOB, 0, 1, 2, "h", 8).message("beat", 1.0, phase="train", step=99)
    assert t.update(old, 11.0) == [] and t.stale == 1 and 1 not in t.ranks
    assert t.effective_resume_step() == 10 and t.max_step == 12
    assert t.local_pids("h") == [7]


def test_a_resume_says_where_it_came_from_when_the_ranks_say():
    m = messages.RankIdentity(JOB, 1, 0, 2, "h", 7).message
    t = AttemptTable(attempt=1, world=2, launched_at=0.0)
    (note,) = t.update(m("resumed", 1.0, step=12, restart_seconds=0.4, source="memory"), 1.0)
    assert note.fields == {"step": 12, "restart_seconds": 0.4, "rank": 0, "source": "memory"}
    assert (t.resume_step, t.resume_source) == (12, "memory")
    t = AttemptTable(attempt=1, world=2, launched_at=0.0)  # ranks without a memory tier
    (note,) = t.update(m("resumed", 1.0, step=10, restart_seconds=0.4), 1.0)
    assert note.fields == {"step": 10, "restart_seconds": 0.4, "rank": 0}
    assert (t.resume_step, t.resume_source) == (10, None)


def test_a_memory_copy_counts_once_every_rank_holds_it():
    """Issue 25: a memory-tier copy is progress, as a durable checkpoint is; the newest step
    every rank said it holds (each rank says its own copies)."""
    t = AttemptTable(attempt=1, world=2, launched_at=0.0)
    r0, r1 = (messages.RankIdentity(JOB, 1, r, 2, "h", 7 + r).message for r in (0, 1))
    assert t.update(r0("ckpt", 1.0, step=4, state="memory"), 1.0) == []  # no event per copy
    assert (t.mem_complete, t.saved_step) == (None, None)  # rank 1 has said none yet
    t.update(r1("ckpt", 1.0, step=3, state="memory"), 1.0)
    assert (t.mem_complete, t.saved_step) == (3, 3)
    t.update(r1("ckpt", 1.0, step=2, state="memory"), 1.0)  # late and older: ignored
    t.update(r1("ckpt", 1.0, step=6, state="memory"), 1.0)
    assert t.mem_complete == 4 and t.ckpt_complete is None
    t.update(r0("ckpt", 1.0, step=5, state="complete"), 2.0)
    assert (t.ckpt_complete, t.saved_step) == (5, 5)
    t.update(r0("ckpt", 1.0, step=8, state="memory"), 1.0)
    assert (t.mem_complete, t.saved_step) == (6, 6)
    messages.validate(r0("ckpt", 1.0, step=8, state="memory"))  # a state the protocol knows


def test_an_allow_list_keeps_other_hosts_from_connecting():
    async def main(allow):
        server = HeartbeatServer(KEY.encode(), JOB, allow=allow)
        with pushing_to(server) as push:
            for _ in range(3):
                beat = RANK0.message("beat", time.time(), phase="train", step=1)
                push.send(messages.encode(KEY.encode(), beat), zmq.NOBLOCK)
            got = await collect(server, lambda g: len(g) >= 3, timeout=1.5)
        server.close()
        return got

    assert len(asyncio.run(main(["127.0.0.1"]))) == 3
    assert asyncio.run(main(["192.0.2.7"])) == []  # loopback is not on the list: refused


def test_node_addresses_has_loopback_and_the_nodes():
    from supervisor.watch.heartbeat import node_addresses

    assert {"127.0.0.1", "::1"} <= set(node_addresses(["localhost", "no-such-host.invalid"]))


def test_a_quiet_intake_wakes_for_each_message_and_leaves_no_watch_behind():
    """A drain that found nothing waits on the socket (no timer): every message sent while it
    waits is handled at once, and the wait leaves nothing on the event loop, so a later server
    in the same loop (given the same descriptor number) still hears its ranks."""

    async def one_server() -> list[float]:
        server = HeartbeatServer(KEY.encode(), JOB)
        handled: list[float] = []
        task = asyncio.create_task(server.serve(lambda m, now: handled.append(time.monotonic())))
        delays = []
        with pushing_to(server) as push:
            for step in range(5):
                await asyncio.sleep(0.05)  # the intake is parked on its socket by now
                sent = time.monotonic()
                beat = RANK0.message("beat", time.time(), phase="train", step=step)
                push.send(messages.encode(KEY.encode(), beat))
                deadline = sent + 5.0
                while len(handled) <= step and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)
                delays.append(handled[step] - sent if len(handled) > step else float("inf"))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        server.close()
        return delays

    async def main():
        return await one_server(), await one_server()

    first, second = asyncio.run(main())
    assert max(first) < 1.0 and max(second) < 1.0, (first, second)  # none left waiting

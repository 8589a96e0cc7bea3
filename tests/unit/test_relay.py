"""Per-node relays: the summary's schema and signing, the relay's folding and forwarding, the
supervisor's folding and judging of summaries (pure parts), and one node of real beacons relaying
over a real node-local socket to the real server."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time

import pytest
import zmq

from contracts import env_names, messages
from supervisor.policy.liveness import judge_ranks
from supervisor.settings.config import HeartbeatConfig, ProgressConfig
from supervisor.watch.heartbeat import HeartbeatServer
from supervisor.watch.rank_table import AttemptTable
from supervisor.watch.relays import RELAY_AUTO_MIN_WORLD, relay_wanted
from tests.support import BEACON_JOB as JOB
from tests.support import BEACON_KEY as KEY
from tests.support import beacon_env
from worker.beat import Beacon, ZmqBeacon
from worker.relay import RelayCore, node_name, relay_address

K = KEY.encode()
HB = HeartbeatConfig(interval_s=1.0, timeout_s=5.0, progress=ProgressConfig(train=30.0))


def ident(rank: int, world: int = 8, attempt: int = 0) -> messages.RankIdentity:
    return messages.RankIdentity(JOB, attempt, rank, world, "host-a", 1000 + rank)


def summary(relay: int, ranks, steps, phases="train", late=(), world=8, node="n0", attempt=0):
    """A relay's summary of these ranks' steps and phases (plain lists: coded here)."""
    if not isinstance(phases, str):
        phases = messages.runs(list(phases))
        phases = phases[0][0] if len(phases) == 1 else phases
    return ident(relay, world, attempt).message(
        "summary", time.time(), node=node, ranks=messages.rank_runs(list(ranks)),
        steps=messages.runs(list(steps)), phases=phases, late=[list(x) for x in late],
    )  # fmt: skip


# --- the summary on the wire --------------------------------------------------------------------
def test_summary_round_trip_and_schema():
    msg = summary(0, [0, 1, 2, 5], [5, 5, 4, 4], ["train", "train", "save", "save"], [(2, 1.5)])
    assert msg["ranks"] == [[0, 3], [5, 1]] and msg["steps"] == [[5, 2], [4, 2]]
    assert msg["phases"] == [["train", 2], ["save", 2]]
    assert messages.decode(K, messages.encode(K, msg), JOB) == msg
    assert messages.expand_ranks(msg["ranks"]) == [0, 1, 2, 5] and messages.expand(
        msg["steps"]
    ) == [5, 5, 4, 4]
    bad = [
        {"ranks": []},
        {"ranks": [[0, 3], [2, 1]]},  # rank 2 twice
        {"ranks": [[5, 1], [0, 3]]},  # not ascending
        {"ranks": [[0, True], [5, 1]]},
        {"ranks": [[0, 0], [5, 4]]},
        {"ranks": [[0, 3, 1], [5, 1]]},
        {"steps": [[5, 3]]},
        {"steps": [[5, 2], [4.5, 2]]},
        {"phases": [["train", 3]]},
        {"phases": [["train", 2], [3, 2]]},
        {"late": [[7, 1.0]]},  # not one of its ranks
        {"late": [[1, -1.0]]},
        {"late": [[1, float("nan")]]},
        {"late": [1]},
        {
            "ranks": [[0, messages.MAX_RELAY_RANKS + 1]],
            "steps": [[1, messages.MAX_RELAY_RANKS + 1]],
        },
        {"node": 3},
        {"steps": "5"},
    ]
    for change in bad:
        m = {**msg, **change}
        with pytest.raises(messages.BadMessage) as exc:
            messages.decode(K, messages.encode(K, m), JOB)
        assert exc.value.reason == "schema", change
    with pytest.raises(messages.BadMessage) as exc:
        messages.decode(b"other-key", messages.encode(K, msg), JOB)
    assert exc.value.reason == "signature"


def test_relay_wanted():
    assert not relay_wanted("auto", 64, 4)
    assert relay_wanted("auto", RELAY_AUTO_MIN_WORLD, 4)
    assert not relay_wanted("auto", 100_000, 1)  # one rank a node: nothing to aggregate
    assert relay_wanted(True, 4, 2) and not relay_wanted(False, 100_000, 12)


def test_node_name_and_address():
    assert node_name({"PMI_HOSTNAME": "n1"}, "box") == "n1"
    assert node_name({}, "box") == "box"
    a = relay_address(K, JOB, 0, "n0")
    assert a.startswith("ipc://") and a == relay_address(K, JOB, 0, "n0")
    assert a != relay_address(K, JOB, 1, "n0") != relay_address(K, JOB, 0, "n1")
    assert a != relay_address(b"another-key", JOB, 0, "n0")


# --- the relay's own folding --------------------------------------------------------------------
def test_relay_core_summarizes_beats_and_forwards_the_rest():
    core = RelayCore(K, ident(0), "n0")
    core.own("hello", {"phase": "init"}, 0.0)

    def frame(rank, kind, **fields):
        return messages.encode(K, ident(rank).message(kind, time.time(), **fields))

    assert core.take(frame(1, "beat", phase="train", step=3), 0.1) is None
    hello = frame(2, "hello", phase="init")
    assert core.take(hello, 0.1) == hello  # forwarded as it came, signed by its rank
    assert core.take(frame(2, "step", step=4, loss=1.0, dt=0.1), 0.2) is None  # rank 2's step
    step0 = frame(0, "step", step=4, loss=1.0, dt=0.1)
    assert core.take(step0, 0.2) == step0  # rank 0's steps drive events: forwarded
    assert core.take(b"x" * 80, 0.2) is None and core.dropped == 1
    other = messages.encode(K, ident(1, attempt=3).message("beat", 0.0, phase="train", step=1))
    assert core.take(other, 0.2) is None and core.dropped == 2
    core.own("beat", {"phase": "train", "step": 4}, 0.3)
    s = core.summary(time.time(), 0.5)
    assert s["ranks"] == [[0, 3]] and s["steps"] == [[4, 1], [3, 1], [4, 1]] and s["late"] == []
    assert s["phases"] == [["train", 2], ["init", 1]] and s["node"] == "n0"
    messages.validate(s)
    # Next interval: only rank 1 beats; ranks 0 and 2 are late, with their ages.
    core.take(frame(1, "beat", phase="train", step=5), 1.2)
    s = core.summary(time.time(), 1.5)
    assert s["late"] == [[0, 1.2], [2, 1.3]]
    # One phase for all: one string.
    for r in (0, 2):
        core.own("beat", {"phase": "train", "step": 5}, 1.6) if r == 0 else core.take(
            frame(2, "beat", phase="train", step=5), 1.6
        )
    assert core.summary(time.time(), 2.0)["phases"] == "train"
    core.take(frame(2, "done", step=9), 2.1)
    s = core.summary(time.time(), 2.2)
    assert s["phases"] == [["train", 2], ["done", 1]] and s["steps"] == [[5, 2], [9, 1]]


# --- the supervisor's folding and judging -------------------------------------------------------
def fed(world=8, per_node=4, now=100.0, step=10, nodes=None):
    """A table fed one summary per node (ranks all training at `step`), at `now`."""
    t = AttemptTable(0, world, 0.0)
    for n in range(world // per_node if nodes is None else nodes):
        ranks = range(n * per_node, (n + 1) * per_node)
        t.update(summary(n * per_node, ranks, [step] * per_node, world=world, node=f"n{n}"), now)
    return t


def test_summaries_make_rank_states_and_move_them():
    t = fed()
    assert sorted(t.ranks) == list(range(8)) and set(t.relays) == {"n0", "n1"}
    assert t.direct == {} and t.judged == 2
    assert all(st.step == 10 and st.phase == "train" for st in t.ranks.values())
    t.update(summary(0, range(4), [11, 11, 10, 11]), 101.0)
    t.relays["n0"].sync()  # states take the summaries' steps when looked at
    assert [t.ranks[r].last_progress for r in range(1, 4)] == [101.0, 100.0, 101.0]
    assert t.ranks[0].step == 10  # rank 0 says each of its steps itself
    assert t.judge(101.5, HB) is None
    t.update(summary(0, range(4), [11, 11, 10, 11], world=4), 101.0)  # another world: stale
    assert t.stale == 1


def test_a_single_silent_rank_is_named_not_its_node():
    t = fed()
    for k in range(1, 8):  # both relays keep summarizing; rank 6 stopped beating at 100
        now = 100.0 + k
        t.update(summary(0, range(4), [10 + k] * 4), now)
        t.update(summary(4, range(4, 8), [10 + k] * 4, late=[(6, k)], node="n1"), now)
        f = t.judge(now + 0.1, HB)
        if f is not None:
            break
    assert f is not None and f.kind == "hang" and f.ranks == (6,) and f.node is None
    assert f.deadline == pytest.approx(105.0)


def first_finding_with_only_n0_heard(t):
    """Judge each second after 100 while only n0's relay sends summaries: the first finding."""
    for k in range(1, 8):
        now = 100.0 + k
        t.update(summary(0, range(4), [10 + k] * 4), now)
        f = t.judge(now + 0.1, HB)
        if f is not None:
            return f
    return None


def test_a_silent_relay_is_its_nodes_failure():
    f = first_finding_with_only_n0_heard(fed())
    assert f is not None and f.kind == "hang" and f.ranks == (4, 5, 6, 7)
    assert f.node == "n1" and "relay of node n1 (rank 4)" in f.reason
    assert f.deadline == pytest.approx(105.0)


@pytest.mark.parametrize(
    "said",
    [
        (4, "step", {"step": 11, "loss": 1.0, "dt": 0.1}),  # the relay's own step, sent straight
        (6, "phase", {"phase": "save", "step": 10}),  # a member's, forwarded by the relay
        (6, "ckpt", {"step": 10, "state": "memory"}),
    ],
)
def test_a_silent_relay_names_every_rank_of_its_node_even_one_heard_after_its_summary(said):
    """A rank of the node heard from after the relay's last summary (and then nothing: the relay
    stopped) is past its own deadline a little later than the others: the node's `hang` still
    names all of its ranks, at the first check past the summary's deadline."""
    t = fed()
    rank, kind, fields = said
    t.update(ident(rank).message(kind, 0.0, **fields), 100.2)
    f = first_finding_with_only_n0_heard(t)
    assert f is not None and f.kind == "hang" and f.ranks == (4, 5, 6, 7), f
    assert f.node == "n1" and "relay of node n1 (rank 4) sent no summary for its 4" in f.reason
    assert f.deadline == pytest.approx(105.0)


def test_a_silent_relay_does_not_name_its_ranks_that_are_done():
    t = fed()
    t.update(ident(7).message("done", 0.0, step=10), 100.05)
    t.update(ident(4).message("step", 0.0, step=11, loss=1.0, dt=0.1), 100.2)
    f = None
    for k in range(1, 8):
        now = 100.0 + k
        t.update(summary(0, range(4), [10 + k] * 4), now)
        f = t.judge(now + 0.1, HB)
        if f is not None:
            break
    assert f is not None and f.kind == "hang" and f.ranks == (4, 5, 6) and f.node == "n1", f


def test_no_progress_of_one_relayed_rank_is_named():
    t = fed()
    heartbeat = dataclasses.replace(HB, progress=ProgressConfig(train=3.0))
    for k in range(1, 8):  # rank 5 beats (it is never late) but its step stays at 10
        now = 100.0 + k
        t.update(summary(0, range(4), [10 + k] * 4), now)
        t.update(summary(4, range(4, 8), [10 + k, 10, 10 + k, 10 + k], node="n1"), now)
        f = t.judge(now + 0.1, heartbeat)
        if f is not None:
            break
    assert f is not None and f.kind == "no_progress" and f.ranks == (5,)


def test_a_relayed_rank_gone_and_ranks_never_heard_from():
    t = fed()
    t.exited(t.ranks[2], 100.5)
    f = t.judge(100.6, HB)
    assert f is not None and f.kind == "rank_exit" and f.ranks == (2,)
    t = fed(world=12, nodes=2)  # ranks 8..11 never heard from: found at the init timeout
    t.launched_at = 100.0 - HB.progress.init - 1
    f = t.judge(100.5, HB)
    assert f is not None and f.kind == "no_progress" and f.ranks == (8, 9, 10, 11)


def test_forwarded_messages_of_relayed_ranks_still_count():
    t = fed()
    notes = t.update(ident(3).message("hello", 0.0, phase="init"), 100.2)
    assert [n.event for n in notes] == ["rank_hello"] and t.on_host("host-a")[0].pid == 1003
    notes = t.update(ident(5).message("done", 0.0, step=12), 100.3)
    assert [n.event for n in notes] == ["rank_done"] and t.ranks[5].phase == "done"
    for k in range(1, 10):  # rank 5 is done: never judged again, even unseen
        t.update(summary(0, range(4), [10 + k] * 4), 100 + k)
        t.update(
            summary(4, range(4, 8), [10 + k, 12, 10 + k, 10 + k], ["train", "done"] + ["train"] * 2,
                    late=[(5, k)], node="n1"),
            100 + k,
        )  # fmt: skip
        assert t.judge(100 + k + 0.1, HB) is None


def test_judging_by_node_finds_what_judging_every_rank_finds():
    """The same facts judged through relays and rank by rank: the same finding."""
    rng = random.Random(7)
    heartbeat = dataclasses.replace(HB, progress=ProgressConfig(train=4.0, save=8.0))
    for trial in range(200):
        world, per = 24, 6
        t = fed(world=world, per_node=per, now=100.0)
        now = 100.0
        silent_node = rng.randrange(6) if trial % 3 == 0 else None
        for k in range(1, rng.randint(2, 9)):
            now = 100.0 + k
            for n in range(world // per):
                if n == silent_node:
                    continue
                ranks = list(range(n * per, (n + 1) * per))
                steps = [10 + k if rng.random() > 0.1 else t.ranks[r].step for r in ranks]
                phases = [rng.choice(["train"] * 8 + ["save"]) for _ in ranks]
                late = [(r, round(rng.uniform(0, k), 3)) for r in ranks if rng.random() < 0.1]
                t.update(summary(ranks[0], ranks, steps, phases, late, world, f"n{n}"), now)
        judged_at = now + rng.uniform(0, 2)
        got = t.judge(judged_at, heartbeat)
        # Rank by rank: each state with the last-seen time its relay gives it.
        flat = {}
        for relay in t.relays.values():
            relay.sync()
            for st in relay.states:
                flat[st.rank] = dataclasses.replace(st, last_seen=relay.seen(st))
        want = judge_ranks(flat, world, judged_at, t.launched_at, heartbeat)
        assert (got is None) == (want is None), trial
        if got is not None:
            assert (got.kind, got.ranks, got.deadline) == (want.kind, want.ranks, want.deadline)


# --- one node over real sockets ------------------------------------------------------------------
def test_a_node_of_real_beacons_relays_through_its_local_rank_0(monkeypatch):
    async def main():
        server = HeartbeatServer(K, JOB)
        beacon_env(monkeypatch, server.address, interval=0.1)
        monkeypatch.setenv(env_names.ENV_HEARTBEAT_RELAY, "1")
        # Abstract socket names are host-wide: another test process must not share this node.
        monkeypatch.setenv("PMI_HOSTNAME", f"unit-node-{os.getpid()}")
        beacons = [Beacon.from_env(r, 3, r, 3) for r in range(3)]
        assert beacons[0].relay is not None and all(b.relay is None for b in beacons[1:])
        table = AttemptTable(0, 3, time.monotonic())
        got: list[dict] = []

        def handle(m, now):
            got.append(m)
            table.update(m, now)

        task = asyncio.create_task(server.serve(handle))
        for b in beacons:
            b.hello("init")
            b.phase("train", 0)
        for step in range(1, 4):
            for b in beacons:
                b.step(step, 1.0, 0.01)
            await asyncio.sleep(0.05)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
            table.relays and all(relay.steps == [3, 3, 3] for relay in table.relays.values())
        ):
            await asyncio.sleep(0.05)
        for b in beacons[::-1]:
            b.done(3)
        for b in beacons[::-1]:
            b.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(table.done_ranks) < 3:
            await asyncio.sleep(0.05)
        task.cancel()
        server.close()
        return got, table, beacons

    got, table, beacons = asyncio.run(main())
    kinds = {m["kind"] for m in got}
    assert "beat" not in kinds and "summary" in kinds  # beats only inside summaries
    assert all(m["rank"] == 0 for m in got if m["kind"] == "summary")
    assert sorted(m["rank"] for m in got if m["kind"] == "hello") == [0, 1, 2]
    assert not any(m["kind"] == "step" and m["rank"] != 0 for m in got)
    assert table.done_ranks == {0, 1, 2} and all(st.step == 3 for st in table.ranks.values())
    assert beacons[0].relay.dropped == 0 and beacons[0].relay.forwarded >= 6


def test_a_forged_frame_on_the_node_socket_is_dropped(monkeypatch):
    core = RelayCore(K, ident(0), "n0")
    forged = messages.encode(b"not-the-key", ident(1).message("beat", 0.0, phase="train", step=1))
    assert core.take(forged, 0.0) is None and core.dropped == 1 and not core.ranks
    ctx = zmq.Context()
    ctx.term()


def test_beacon_without_relay_env_is_unchanged(monkeypatch):
    beacon_env(monkeypatch, "tcp://127.0.0.1:9")
    monkeypatch.delenv(env_names.ENV_HEARTBEAT_RELAY, raising=False)
    b = Beacon.from_env(1, 4, 1, 4)
    assert isinstance(b, ZmqBeacon) and b.relay is None and b._addr == "tcp://127.0.0.1:9"
    b.close()
    monkeypatch.setenv(env_names.ENV_HEARTBEAT_RELAY, "1")
    b = Beacon.from_env(0, 4, 0, 1)  # alone on its node: no relay
    assert b.relay is None
    b.close()

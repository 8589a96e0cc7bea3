"""faults/: parsing, the pure schedule (which faults fire when), checkpoint damage, and the
control channel over real ZeroMQ sockets. No ranks here: see e2e/test_faults_e2e.py for those."""

from __future__ import annotations

import os
import signal
import time

import pytest
import zmq

from contracts import ckpt_files as ckpt_files
from contracts import control_msgs, messages
from faults import actions
from faults.schedule import Facts, Schedule, interval, targets
from faults.spec import JobShape, parse_all
from supervisor.commands import cli
from supervisor.settings import config as C
from supervisor.watch.control import ControlServer
from tests.support import fake_checkpoints
from worker.beat import ZmqBeacon
from worker.control_channel import ControlChannel
from worker.step_commands import StepFaults

SHAPE = JobShape(train_iters=100, save_interval=10, world=4, nodes=2, ranks_per_node=2)
ALL = frozenset(range(4))


def specs(*tables: dict, shape: JobShape = SHAPE):
    return parse_all(list(tables), "job.toml", shape)


def facts(**kw) -> Facts:
    base = {"elapsed_s": 0.0, "world": 4, "ranks_per_node": 2, "attempt": 0, "ready": ALL,
            "training": ALL, "step": 1}  # fmt: skip
    return Facts(**{**base, **kw})


# --- parsing ------------------------------------------------------------------------------------
def test_parse_every_trigger_action_and_target():
    s = specs(
        {"at_s": [20, 5], "action": "kill", "signal": "TERM"},
        {"every_s": 20, "jitter_s": 5, "count": 3, "seed": 1, "action": "hang", "target": "rank:3"},
        {"mtbf_s": 600, "seed": 7, "action": "kill", "target": "random"},
        {"at_step": [50, 10], "after_checkpoint": True, "action": "unmark", "via": "control"},
        {"every_steps": 30, "action": "slow", "delay_s": 0.5, "duration_s": 10, "target": "node:1"},
        {"during": "save", "action": "corrupt", "name": "in-save"},
        {"during": "save", "at_step": 25, "action": "stall"},
        {"at_step": 10, "action": "term"},
    )
    assert s[0].trigger.at_s == (5.0, 20.0) and s[0].action.signum == signal.SIGTERM
    assert s[1].trigger.jitter_s == 5 and s[1].trigger.count == 3 and str(s[1].target) == "rank:3"
    assert s[1].action.signum == signal.SIGSTOP
    assert s[2].trigger.kind == "mtbf_s" and s[2].target.kind == "random"
    assert s[3].trigger.at_step == (10, 50) and s[3].via == "control"
    assert s[3].action.signum == signal.SIGKILL
    assert s[4].target.kind == "node" and s[4].action.delay_s == 0.5
    assert s[5].trigger.count == 1 and s[5].label == "in-save"
    assert s[6].trigger.at_step == (25,) and s[7].action.signum == signal.SIGTERM


BAD = [
    ({"action": "kill"}, "faults[0]", "expected a trigger"),
    ({"at_s": [1], "at_step": 3, "action": "kill"}, "faults[0].at_step", "one trigger"),
    ({"at_s": [1], "action": "explode"}, "faults[0].action", "expected one of"),
    ({"at_s": [1], "action": "kill", "colour": 1}, "faults[0].colour", "unknown key"),
    ({"at_s": [1], "action": "kil"}, "faults[0].action", "expected one of"),
    ({"at_sec": [1], "action": "kill"}, "faults[0].at_sec", "did you mean 'at_s'"),
    ({"at_s": [-1], "action": "kill"}, "faults[0].at_s", ">= 0"),
    ({"every_s": 10, "jitter_s": 10, "action": "kill"}, "faults[0].jitter_s", "< every_s"),
    ({"mtbf_s": 0, "action": "kill"}, "faults[0].mtbf_s", "positive"),
    ({"at_step": 100, "action": "kill"}, "faults[0].at_step", "never reached"),
    ({"every_steps": 100, "action": "kill"}, "faults[0].every_steps", "no multiple"),
    (
        {"at_step": 95, "after_checkpoint": True, "action": "kill"},
        "faults[0].after_checkpoint",
        "no checkpoint at or after step 95",
    ),  # fmt: skip
    (
        {"at_s": [1], "after_checkpoint": True, "action": "kill"},
        "faults[0].after_checkpoint",
        "does not apply",
    ),  # fmt: skip
    ({"at_s": [1], "action": "kill", "target": "rank:4"}, "faults[0].target", "4 ranks"),
    ({"at_s": [1], "action": "kill", "target": "node:2"}, "faults[0].target", "2 node(s)"),
    ({"at_s": [1], "action": "kill", "target": "some"}, "faults[0].target", "rank:N"),
    ({"at_s": [1], "action": "kill", "signal": "SIGNOPE"}, "faults[0].signal", "signal name"),
    ({"at_s": [1], "action": "term", "signal": 9}, "faults[0].signal", "always sends SIGTERM"),
    ({"at_s": [1], "action": "slow", "delay_s": 1}, "faults[0].duration_s", "missing"),
    ({"at_s": [1], "action": "hang", "delay_s": 1}, "faults[0].delay_s", "does not apply"),
    ({"at_s": [1], "action": "corrupt", "mode": "flip"}, "faults[0].mode", "ckpt_verify"),
    ({"at_s": [1], "action": "kill", "via": "pigeon"}, "faults[0].via", "expected one of"),
]


@pytest.mark.parametrize("table,key,fragment", BAD)
def test_bad_fault_tables_name_the_key(table, key, fragment):
    with pytest.raises(C.ConfigError) as err:
        specs(table)
    assert err.value.key == key and err.value.source == "job.toml"
    assert fragment in err.value.message


def test_no_saves_means_no_checkpoint_faults():
    shape = JobShape(train_iters=100, save_interval=0)
    for table, key in (
        ({"during": "save", "action": "kill"}, "faults[0].during"),
        ({"at_s": [1], "action": "unmark"}, "faults[0].action"),
        ({"at_step": 5, "after_checkpoint": True, "action": "kill"}, "faults[0].after_checkpoint"),
    ):
        with pytest.raises(C.ConfigError) as err:
            specs(table, shape=shape)
        assert err.value.key == key


def test_config_errors_exit_2_naming_file_and_key(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(
        "[launch]\nranks_per_node = 2\n[worker]\ntrain_iters = 50\n"
        "[[faults]]\nat_step = [60]\naction = 'kill'\n"
    )
    for command in ("validate", "run"):
        assert cli.main([command, str(path)]) == 2
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"error: {path}: faults[0].at_step: step 60 is never reached")
    # A rank beyond the resolved world (nodes "auto": known only once resolved).
    path.write_text("[launch]\nranks_per_node = 2\n[[faults]]\nat_s = [1]\naction = 'hang'\n"
                    "target = 'rank:2'\n")  # fmt: skip
    assert cli.main(["validate", str(path)]) == 2
    assert "faults[0].target: rank 2 does not exist: the job has 2 ranks" in capsys.readouterr().err


# --- the schedule -------------------------------------------------------------------------------
def test_at_s_fires_once_per_point_when_due():
    sched = Schedule(specs({"at_s": [5, 10], "action": "kill"}))
    assert sched.due(facts(elapsed_s=4.99)) == []
    (f,) = sched.due(facts(elapsed_s=5.0))
    assert f.point == {"due_s": 5.0} and f.due_s == 5.0 and f.ranks == (0, 1, 2, 3) and f.n == 1
    assert sched.due(facts(elapsed_s=6.0, attempt=1)) == []
    (f,) = sched.due(facts(elapsed_s=10.5, attempt=1))
    assert f.n == 2 and f.due_s == 10.0
    assert sched.due(facts(elapsed_s=99, attempt=2)) == []
    assert sched.fired() == {"faults[0]": 2}


def test_a_point_waits_for_its_ranks_and_for_a_live_attempt():
    sched = Schedule(specs({"at_s": [5], "action": "kill", "target": "rank:3"}))
    assert sched.due(facts(elapsed_s=6, attempt=None)) == []  # between attempts
    three = frozenset({0, 1, 2})
    assert sched.due(facts(elapsed_s=6, ready=three, training=three)) == []  # rank 3 not up
    assert sched.due(facts(elapsed_s=6, training=three)) == []  # rank 3 still loading
    assert sched.due(facts(elapsed_s=6, step=None)) == []  # no step done in this attempt yet
    assert sched.due(facts(elapsed_s=6, disrupted=True)) == []  # this attempt is already hit
    assert sched.due(facts(elapsed_s=6, finishing=True)) == []  # the job is done
    (f,) = sched.due(facts(elapsed_s=7))
    assert f.ranks == (3,) and f.due_s == 5


def test_one_disruptive_fault_per_attempt_but_slow_adds_on():
    sched = Schedule(
        specs(
            {"at_s": [1], "action": "slow", "delay_s": 0.1, "duration_s": 5},
            {"at_s": [1], "action": "kill"},
            {"at_s": [1], "action": "hang"},
        )
    )
    fired = sched.due(facts(elapsed_s=2))
    assert [f.spec.action.kind for f in fired] == ["slow", "kill"]
    (f,) = sched.due(facts(elapsed_s=3, attempt=1))
    assert f.spec.action.kind == "hang"


def test_every_s_with_jitter_counts_from_the_previous_firing():
    (spec,) = specs({"every_s": 20, "jitter_s": 5, "count": 3, "seed": 4, "action": "kill"})
    gaps = [interval(spec.trigger, n) for n in (1, 2, 3)]
    assert all(15 <= g <= 25 for g in gaps) and len(set(gaps)) == 3
    sched = Schedule([spec])
    assert sched.next_time_s(0) == pytest.approx(gaps[0])
    (f,) = sched.due(facts(elapsed_s=gaps[0] + 4))  # fired late (ranks were restarting)
    assert sched.next_time_s(0) == pytest.approx(gaps[0] + 4 + gaps[1])
    t = gaps[0] + 4
    for n in (2, 3):
        t += gaps[n - 1]
        assert len(sched.due(facts(elapsed_s=t, attempt=n))) == 1
    assert sched.due(facts(elapsed_s=1e6, attempt=9)) == [] and sched.next_time_s(0) is None


def run_mtbf(seed: int, horizon: float = 3600.0) -> list[float]:
    sched = Schedule(specs({"mtbf_s": 120, "seed": seed, "action": "kill", "target": "random"}))
    times, ranks, t, attempt = [], [], 0.0, 0
    while t < horizon:
        for f in sched.due(facts(elapsed_s=t, attempt=attempt)):
            times.append(round(t, 1))
            ranks.append(f.ranks)
            attempt += 1
        t += 0.1
    return times, ranks


def test_mtbf_with_a_seed_injects_the_same_times_twice():
    a, b, other = run_mtbf(7), run_mtbf(7), run_mtbf(8)
    assert a == b and a != other
    times = a[0]
    gaps = [y - x for x, y in zip([0.0, *times], times, strict=False)]
    assert 10 <= len(times) <= 60  # 3600 s / 120 s = 30 expected
    assert 60 < sum(gaps) / len(gaps) < 240
    assert len(set(a[1])) > 1  # a random target draws different ranks


def test_at_step_fires_at_the_first_step_reaching_it_and_never_again():
    sched = Schedule(specs({"at_step": [5, 8], "action": "kill"}))
    assert sched.due(facts(step=4)) == []
    assert sched.due(facts(step=5, ready=frozenset({0, 1, 2}))) == []
    (f,) = sched.due(facts(step=5))
    assert f.point == {"step": 5} and f.due_s is None
    assert sched.due(facts(step=6, disrupted=True)) == []
    # The next attempt resumed from step 0: step 5 again fires nothing, step 8 does.
    assert sched.due(facts(attempt=1, step=5)) == []
    (f,) = sched.due(facts(attempt=1, step=9))
    assert f.point == {"step": 8}


def test_after_checkpoint_waits_for_the_marker_at_or_past_the_step():
    sched = Schedule(specs({"at_step": 15, "after_checkpoint": True, "action": "kill"}))
    assert sched.due(facts(step=17, ckpt_complete=10)) == []
    assert sched.due(facts(step=20, saving=20, ckpt_complete=10)) == []
    (f,) = sched.due(facts(step=21, ckpt_complete=20))
    assert f.point == {"step": 15}


def test_every_steps_points():
    sched = Schedule(specs({"every_steps": 30, "action": "term"}))
    got = []
    for attempt, step in enumerate(range(1, 100)):
        for f in sched.due(facts(attempt=attempt, step=step)):
            got.append((f.point["step"], step))
    assert got == [(30, 30), (60, 60), (90, 90)]


def test_during_save():
    sched = Schedule(specs({"during": "save", "action": "kill"}))
    assert sched.due(facts(step=9)) == []
    (f,) = sched.due(facts(step=10, saving=10))
    assert f.point == {"save": 10}
    assert sched.due(facts(attempt=1, step=20, saving=20)) == []  # count 1 by default
    sched = Schedule(specs({"during": "save", "at_step": 25, "action": "kill"}))
    assert sched.due(facts(step=20, saving=20)) == []
    (f,) = sched.due(facts(step=30, saving=30))
    assert f.point == {"save": 30, "step": 25}


def test_checkpoint_damage_waits_for_a_complete_checkpoint():
    sched = Schedule(specs({"at_step": 3, "action": "corrupt"}))
    assert sched.due(facts(step=5)) == []
    assert len(sched.due(facts(step=5, ckpt_complete=0))) == 1


def test_targets():
    (node, rnd) = specs(
        {"at_s": [1], "action": "kill", "target": "node:1"},
        {"at_s": [1], "action": "kill", "target": "random", "seed": 3},
    )
    assert targets(node, 1, 4, 2) == (2, 3)
    draws = [targets(rnd, n, 4, 2) for n in range(1, 30)]
    assert draws == [targets(rnd, n, 4, 2) for n in range(1, 30)]
    assert {d for (d,) in draws} == {0, 1, 2, 3}


# --- actions --------------------------------------------------------------------------------------


def test_corrupt_truncates_or_flips_a_shard_of_the_newest_checkpoint(tmp_path):
    fake_checkpoints(tmp_path)
    d10 = ckpt_files.step_dir(tmp_path, 10)
    damage = actions.corrupt(tmp_path, "truncate", rank=1)
    assert (damage.step, damage.file, damage.bytes_before, damage.bytes_after) == (
        10, "__1_0.distcp", 1024, 512
    )  # fmt: skip
    files = ckpt_files.read_meta(d10)["files"]
    assert "512 bytes, 1024 recorded" in ckpt_files.verify_problem(d10, files)
    before = (d10 / "__0_0.distcp").read_bytes()
    damage = actions.corrupt(tmp_path, "flip", rank=0)
    after = (d10 / "__0_0.distcp").read_bytes()
    assert sum(a != b for a, b in zip(before, after, strict=True)) == 64


def test_unmark_removes_the_newest_marker(tmp_path):
    fake_checkpoints(tmp_path)
    damage = actions.unmark(tmp_path)
    assert damage.step == 10 and damage.how == "unmark"
    assert [f.step for f in ckpt_files.resume_candidates(ckpt_files.scan(tmp_path))] == [5]
    assert actions.unmark(tmp_path / "none") is None


def test_signal_by_pid():
    assert actions.send_signal(2**22 + 12345, signal.SIGKILL).endswith("is gone")


# --- the control channel --------------------------------------------------------------------------
def test_control_channel_reaches_the_rank_and_only_that_rank(monkeypatch):
    key = b"k" * 32
    server = ControlServer(key, "job", "127.0.0.1", "127.0.0.1")
    pull = zmq.Context.instance().socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ident = messages.RankIdentity("job", 3, 1, 2, "h", os.getpid())
    beacon = ZmqBeacon(f"tcp://127.0.0.1:{port}", key, ident, 0.05, server.address)
    try:
        slow = control_msgs.control_message("job", 3, 1, time.time(), "slow", 0, delay_s=0.01,
                                        duration_s=0.2)  # fmt: skip
        deadline = time.monotonic() + 10
        while (err := server.send(3, 1, slow)) is not None:
            assert time.monotonic() < deadline, err
            time.sleep(0.01)
        assert server.send(3, 0, slow) == "rank not connected to the control channel"
        # A command for another attempt, or wrongly signed, is dropped by the rank.
        conn = server.owner(3, 1)
        server._sock.send_multipart([conn, messages.encode(key, {**slow, "attempt": 2})])
        server._sock.send_multipart([conn, messages.encode(b"x" * 32, slow)])
        got = []
        while not got and time.monotonic() < deadline:
            got = beacon.commands()
            time.sleep(0.01)
        assert [c["action"] for c in got] == ["slow"] and got[0]["duration_s"] == 0.2
        while beacon.control_dropped < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert beacon.control_dropped == 2

        class Fake:
            def __init__(self, cmds):
                self.cmds = cmds

            def commands(self):
                out, self.cmds = self.cmds, []
                return out

        hook = StepFaults(Fake(got))
        t0 = time.monotonic()
        hook.apply()
        assert time.monotonic() - t0 >= 0.01  # slowed
        time.sleep(0.25)
        t0 = time.monotonic()
        hook.apply()
        assert time.monotonic() - t0 < 0.01  # duration over
    finally:
        beacon.close()
        pull.close(0)
        server.close()


def test_control_message_checks():
    key = b"k" * 32
    msg = control_msgs.control_message("job", 0, 1, 1.0, "signal", 2, signal=9)
    frame = messages.encode(key, msg)
    assert control_msgs.decode_control(key, frame, "job", 0, 1)["signal"] == 9
    for args, reason in (
        (("job", 0, 0), "other_job"),
        (("job", 1, 1), "other_job"),
        (("other", 0, 1), "other_job"),
    ):
        with pytest.raises(messages.BadMessage) as err:
            control_msgs.decode_control(key, frame, *args)
        assert err.value.reason == reason
    with pytest.raises(messages.BadMessage):
        control_msgs.decode_control(
            key, messages.encode(key, {**msg, "action": "reboot"}), "job", 0, 1
        )
    with pytest.raises(messages.BadMessage):
        control_msgs.decode_control(key, messages.encode(key, {**msg, "signal": "9"}), "job", 0, 1)


# --- the engine ---------------------------------------------------------------------------------


def test_a_fault_to_many_ranks_never_stalls_the_event_loop():
    """Ranks whose control socket is not connected are retried from the loop, not slept for
    on it (it was 0.2 s of time.sleep per such rank: 3.2 s here). bench/fault_loop_lag.py
    measures the same with ranks connecting during the retries."""
    import asyncio

    from faults import FaultEngine
    from faults.delivery import CONTROL_RETRY_S
    from supervisor.watch.rank_table import AttemptTable

    world, connected = 64, 48
    events = []
    (spec,) = specs({"at_step": 1, "action": "stall"}, shape=JobShape(world=world, nodes=1))
    control = ControlServer(b"k" * 32, "job", "127.0.0.1", "127.0.0.1")
    engine = FaultEngine(
        [spec], job_id="job", world=world, ranks_per_node=world, ckpt_dir=None, this_host="h",
        emit=lambda e, **kw: events.append({"event": e, **kw}), control=control,
        owns_control=True,
    )  # fmt: skip
    ctx = zmq.Context()
    dealers = []
    for r in range(connected):  # the ranks' real ends (their hello, the job's CURVE keys)
        ident = messages.RankIdentity("job", 0, r, world, "h", os.getpid())
        s = ControlChannel(control.address, b"k" * 32, ident).open(ctx, zmq)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        dealers.append(s)
    table = AttemptTable(attempt=0, world=world, launched_at=0.0)
    for r in range(world):
        msg = {"attempt": 0, "rank": r, "world": world, "host": "h", "pid": 1, "t": 0.0}
        table.update({**msg, "kind": "hello", "phase": "init"}, 0.0)
        table.update({**msg, "kind": "step", "step": 1, "loss": 1.0, "dt": 0.1}, 0.0)
        table.update({**msg, "kind": "phase", "phase": "train", "step": 1}, 0.0)

    async def main() -> float:
        deadline = time.monotonic() + 10  # every connected rank routable before the fault
        for r in range(connected):
            while control.send(0, r, {}) is not None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
        engine.attempt_started(0)
        worst, done = 0.0, False

        async def ticks() -> None:
            nonlocal worst
            while not done:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                worst = max(worst, time.perf_counter() - t)

        ticker = asyncio.create_task(ticks())
        await asyncio.sleep(0.02)
        engine.fire_due(table, time.monotonic())
        await asyncio.sleep(CONTROL_RETRY_S + 0.2)
        done = True
        await ticker
        return worst

    try:
        worst = asyncio.run(main())
        assert worst < 0.1, f"the loop stalled {worst:.3f} s"
        fault, undelivered = events  # `fault` for the ranks reached, once the retries ended
        assert fault["event"] == "fault" and "errors" not in fault and "retrying" not in fault
        assert fault["ranks"] == list(range(connected)) and len(fault["pids"]) == connected
        assert undelivered["event"] == "fault_undelivered"
        assert undelivered["ranks"] == list(range(connected, world))
        for r, s in enumerate(dealers):  # the connected ones got their command (after the probe)
            frames = [s.recv_multipart()[-1] for _ in range(2)]
            assert (
                control_msgs.decode_control(b"k" * 32, frames[1], "job", 0, r)["action"] == "stall"
            )
    finally:
        engine.close()
        for s in dealers:
            s.close()
        ctx.term()

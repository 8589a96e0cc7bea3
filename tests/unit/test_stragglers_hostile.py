"""Stragglers against a hostile user: `replace` in a job that makes no durable checkpoints is
refused, and one found near the end waits for no relaunch; every step of every rank is one
observation where the ranks say their steps (`recent`), so the window counts steps; malformed
`recent` fields are refused; the beacon's list of steps stays ascending through a roll-back."""

from __future__ import annotations

import asyncio
import time

import pytest

from contracts import messages
from supervisor.policy.stragglers import StragglerScore, replace_now, respond
from supervisor.reporting.stragglers_md import straggler_rows, stragglers_lines
from supervisor.run.stragglers import StragglerWatch
from supervisor.settings.loading import from_dict
from supervisor.watch.heartbeat import HeartbeatServer
from supervisor.watch.step_times import StepTimes
from tests.support import BEACON_JOB as JOB
from tests.support import BEACON_KEY, beacon_env
from worker.beat import Beacon
from worker.recent_steps import RecentSteps

NODES = ["n0", "n1", "n2", "n3"]


def beat(rank: int, step: int, recent: list | None = None, **fields) -> dict:
    ident = messages.RankIdentity(JOB, 0, rank, 4, "h", 1)
    extra = {"recent": recent} if recent is not None else {}
    return ident.message("beat", 0.0, phase="train", step=step, **fields, **extra)


def rank_2_slow(watch: StragglerWatch, step: int) -> None:
    """Every rank's beat of `step`, rank 2's compute three times the others'."""
    for rank in range(4):
        c = 0.3 if rank == 2 else 0.1
        watch.on_message(beat(rank, step, [[step, c]], compute=c))


# --- replace that could never act -------------------------------------------------------------
@pytest.mark.parametrize("worker", [{}, {"save_interval": 0}])
def test_replace_without_durable_checkpoints_is_reported_only_saying_why(worker):
    """Accepted (an experiment's baseline phase turns checkpoints off), but nothing waits."""
    cfg = from_dict({"stragglers": {"action": "replace", "window": 2}, "worker": worker})
    said: list = []
    w = StragglerWatch(cfg, 4, NODES, lambda: 1, lambda e, **f: said.append(f))
    for step in range(1, 5):
        rank_2_slow(w, step)
        w.check(None)
    (found,) = said
    assert found["action"] == "report" and "worker.save_interval 0" in found["done"]
    assert w.replacing is None


def test_a_replacement_is_due_after_a_newer_checkpoint_but_not_the_job_s_last():
    assert not replace_now(10, None, 24)
    assert not replace_now(10, 8, 24) and not replace_now(10, 10, 24)
    assert replace_now(10, 12, 24) and replace_now(10, 12, None)
    assert not replace_now(22, 24, 24)  # the job is over: a relaunch would only load and stop


def test_a_straggler_found_in_the_last_steps_relaunches_nothing():
    cfg = from_dict(
        {
            "stragglers": {"action": "replace", "window": 3},
            "worker": {"save_interval": 4, "train_iters": 12},
        }
    )
    said: list = []
    w = StragglerWatch(cfg, 4, NODES, lambda: 1, lambda e, **f: said.append(f))
    for step in range(9, 13):
        rank_2_slow(w, step)
        w.check(8)
    assert said and said[0]["action"] == "replace" and w.replacing is not None
    w.check(12)  # the last step's checkpoint: the job ends on its own
    assert not w.replace_due.is_set()


# --- one observation a step -------------------------------------------------------------------
def test_every_step_every_rank_said_is_one_observation():
    times = StepTimes(3)
    times.take(beat(0, 5, [[3, 0.1], [4, 0.1], [5, 0.1]], compute=0.1))
    times.take(beat(1, 4, [[3, 0.2], [4, 0.2]], compute=0.2))
    assert times.observations() == []  # rank 2 said nothing yet
    times.take(beat(2, 5, [[2, 0.3], [3, 0.3], [4, 0.3], [5, 0.3]], compute=0.3))
    got = times.observations()
    assert got == [(3, {0: 0.1, 1: 0.2, 2: 0.3}), (4, {0: 0.1, 1: 0.2, 2: 0.3})]
    assert times.observations() == []  # rank 1 has not said step 5 yet
    times.take(beat(1, 6, [[5, 0.25], [6, 0.2]], compute=0.2))
    assert times.observations() == [(5, {0: 0.1, 1: 0.25, 2: 0.3})]
    assert all(s == {} or min(s) > 5 for s in times.steps.values())  # observed ones let go


def test_ranks_without_their_steps_fall_back_to_their_latest():
    """A relay's summary says only each rank's latest: one observation once all moved on."""
    times = StepTimes(2)
    times.take(beat(0, 7, [[6, 0.1], [7, 0.1]], compute=0.1))
    times.take(beat(1, 7, compute=0.2))
    assert times.observations() == [(7, {0: 0.1, 1: 0.2})]
    assert times.observations() == []


def test_the_window_counts_steps_and_the_finding_says_which():
    """Beats once a second, steps of 0.1 s (60 ms of compute, 40 ms of wait): a rank slowed by
    half a step is named within 30 steps, and the event's window is ten steps."""
    w = StragglerWatch(from_dict({}), 4, NODES, lambda: 0, lambda e, **f: found.append(f))
    found: list = []
    for beat_no in range(8):  # ten steps a beat; rank 2 slow from step 21
        steps = range(beat_no * 10 + 1, beat_no * 10 + 11)
        for rank in range(4):
            pairs = [[s, 0.11 if rank == 2 and s > 20 else 0.06] for s in steps]
            w.on_message(beat(rank, steps[-1], pairs, compute=pairs[-1][1]))
        w.check(None)
    (first,) = found
    assert first["ranks"] == [2] and first["step"] - 20 <= 30
    assert first["window"] == 10 and first["step"] - first["since_step"] + 1 == 10


# --- hostile fields ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "recent",
    [
        "1",
        [[1]],
        [[1, -0.1]],
        [[1, float("nan")]],
        [[1, float("inf")]],
        [[1, 1e9]],
        [[1, "0.1"]],
        [[True, 0.1]],
        [[1.0, 0.1]],
        [[2, 0.1], [1, 0.1]],  # not ascending
        [[1, 0.1], [1, 0.1]],  # twice
        [[s, 0.1] for s in range(messages.MAX_RECENT + 1)],  # too many
    ],
)
def test_a_malformed_recent_field_is_refused(recent):
    with pytest.raises(messages.BadMessage):
        messages.validate(beat(0, 9, recent))


@pytest.mark.parametrize("compute", [[0.1, 0.1, 0.1], [], [0.1, float("nan")], [0.1, True]])
def test_a_summary_s_compute_of_the_wrong_length_or_kind_is_refused(compute):
    ident = messages.RankIdentity(JOB, 0, 0, 4, "h", 1)
    message = ident.message(
        "summary", 0.0, node="n0", ranks=[[0, 2]], steps=[[3, 2]], phases="train", late=[]
    )
    message["compute"] = compute
    with pytest.raises(messages.BadMessage):
        messages.validate(message)


def test_a_well_formed_recent_field_is_accepted():
    messages.validate(beat(0, 9, [[s, 0.1] for s in range(messages.MAX_RECENT)]))
    messages.validate(beat(0, 9, []))


def test_hostile_but_valid_steps_move_nothing():
    """Ranks out of the world, steps far ahead or long observed: no crash, no finding."""
    times = StepTimes(2)
    score = StragglerScore(1.6, 2)
    times.take(beat(7, 3, [[3, 99.0]], compute=99.0))  # no such rank
    times.take(beat(0, 3, [[3, 0.1]], compute=0.1))
    times.take(beat(1, 3, [[3, 0.1]], compute=0.1))
    assert times.observations() == [(3, {0: 0.1, 1: 0.1})]
    times.take(beat(0, 10**9, [[10**9, 0.1]], compute=0.1))  # far ahead: nothing to match
    times.take(beat(1, 4, [[2, 50.0], [3, 50.0], [4, 0.1]], compute=0.1))  # 2, 3: observed
    for step, computes in times.observations():
        assert score.observe(step, computes, lambda r: NODES[r]) == []


def test_every_rank_slow_is_no_straggler():
    score = StragglerScore(1.6, 3)
    found = [score.observe(i, {r: 0.1 if i < 5 else 0.4 for r in range(4)}, str) for i in range(20)]
    assert not any(found)


# --- the beacon's side ------------------------------------------------------------------------
def test_the_beacon_s_steps_stay_ascending_through_a_roll_back():
    recent = RecentSteps()
    for step in (1, 2, 3):
        recent.add(step, 0.1)
    assert recent.take() == [[1, 0.1], [2, 0.1], [3, 0.1]] and recent.take() == []
    for step in (4, 5, 3, 4):  # the guard rolled back to step 2's checkpoint
        recent.add(step, 0.2)
    assert recent.take() == [[3, 0.2], [4, 0.2]]
    for step in range(1, 200):
        recent.add(step, 0.1)
    sent = recent.take()
    assert len(sent) == messages.MAX_RECENT and sent[-1] == [199, 0.1]
    messages.validate(beat(0, 199, sent))


def test_the_report_says_the_steps_the_window_spanned():
    event = {"event": "straggler", "attempt": 0, "step": 30, "ranks": [2], "node": "n2",
             "score": 2.0, "window": 10, "since_step": 21, "action": "report",
             "done": "reported"}  # fmt: skip
    (line,) = stragglers_lines(straggler_rows([event]))
    assert "over 10 (steps 21-30)" in line


# --- what is done about it --------------------------------------------------------------------
def test_no_restart_left_means_the_finding_is_reported_only():
    r = respond("replace", 1, False, 4, 1, pending=False, restarts_left=0)
    assert not r.replace and "max_restarts" in r.said
    assert respond("replace", 1, False, 4, 1, pending=False, restarts_left=1).replace


def test_slow_ranks_on_two_nodes_at_once_one_replacement_the_other_reported():
    cfg = from_dict({"stragglers": {"action": "replace"}, "worker": {"save_interval": 4}})
    said: list = []
    w = StragglerWatch(cfg, 6, NODES + ["n4", "n5"], lambda: 1, lambda e, **f: said.append(f))
    for step in range(1, 12):
        for rank in range(6):
            c = 0.3 if rank in (1, 4) else 0.1
            w.on_message({**beat(rank, step, [[step, c]], compute=c), "world": 6})
        w.check(None)
    assert [(f["node"], f["action"]) for f in said] == [("n1", "replace"), ("n4", "report")]
    assert "already pending" in said[1]["done"] and w.replacing.node == "n1"


def test_a_rank_s_messages_carry_every_step_though_it_says_few(monkeypatch):
    """A real beacon of rank 1 (its `step` messages at most one an interval): 30 quick steps,
    and the `recent` of its steps and beats, as the server verified them, hold every one."""

    async def main() -> list[dict]:
        server = HeartbeatServer(BEACON_KEY.encode(), JOB)
        beacon_env(monkeypatch, server.address, interval=0.2)
        b = Beacon.from_env(1, 2)
        got: list[dict] = []
        task = asyncio.create_task(server.serve(lambda m, now: got.append(m)))
        for step in range(1, 31):
            b.timing(0.01 * step, 0.001)
            b.step(step, 1.0, 0.01)
            await asyncio.sleep(0.02)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(
            p[0] == 30 for m in got for p in m.get("recent", ())
        ):
            await asyncio.sleep(0.02)
        task.cancel()
        b.close()
        server.close()
        return got

    got = asyncio.run(main())
    said = [p for m in got for p in m.get("recent", ())]
    assert [p[0] for p in said] == list(range(1, 31))
    assert said[4] == [5, 0.05] and sum(m["kind"] == "step" for m in got) < 30


def test_a_replacement_its_attempt_never_reached_says_why():
    found = {"event": "straggler", "attempt": 0, "step": 10, "ranks": [2], "node": "n2",
             "score": 2.5, "window": 10, "action": "replace", "done": "a spare takes"}  # fmt: skip
    failed = {"event": "attempt_end", "attempt": 0, "outcome": "failure"}
    (row,) = straggler_rows([found, failed, {"event": "launch", "attempt": 1}])
    assert row.done == "a spare takes (not done: attempt 0 ended first, failure)"
    (row,) = straggler_rows([found, {**failed, "outcome": "success"}])
    assert row.done.endswith("ended first, success)")  # a checkpoint of the job's last step

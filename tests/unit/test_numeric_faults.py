"""`nan` and `spike` faults act at their very step, each point its own bad step, and a `fault`
event means the rank acted (issue 40): the pure schedule (sent ahead, every point in reach at
once, given back when its attempt ends first), the ledger of firings in flight, and the engine
fed the ranks' `fault_ack`s (a recording control channel, no ranks)."""

from __future__ import annotations

import pytest

from contracts.config_table import ConfigError
from faults import FaultEngine
from faults.inflight import InFlight, Pending, events
from faults.schedule import AHEAD_STEPS, Facts, Schedule
from faults.spec import JobShape, parse_all
from supervisor.watch.rank_table import AttemptTable

SHAPE = JobShape(train_iters=100, save_interval=10, world=2, nodes=1, ranks_per_node=2)
BOTH = frozenset({0, 1})
POINTS = list(range(5, 26))


def specs(*tables: dict):
    return parse_all(list(tables), "job.toml", SHAPE)


def facts(step: int | None, attempt: int = 0, **kw) -> Facts:
    return Facts(elapsed_s=1.0, world=2, ranks_per_node=2, attempt=attempt, ready=BOTH,
                 training=BOTH, step=step, **kw)  # fmt: skip


def test_consecutive_points_go_ahead_each_naming_its_own_step():
    """Before: point N fired once step N was seen and named the rank's next step as last seen
    (a rank other than 0 says its step once a beat): two points could name one step, and each
    landed 2 steps late. Now each goes AHEAD_STEPS before its step and names it."""
    sched = Schedule(specs({"at_step": POINTS, "action": "nan", "target": "rank:1"}))
    assert sched.due(facts(None)) == []  # the first point is more than AHEAD_STEPS away
    sent = []
    for step in range(1, 30):
        for _ in range(3):  # rank 0's messages and the watch's ticks: many calls a step
            sent += [(f.point["step"], f.at_step, step) for f in sched.due(facts(step))]
    assert [p for p, _, _ in sent] == POINTS  # each point once
    assert all(at == p and p - seen == AHEAD_STEPS for p, at, seen in sent)


def test_every_point_in_reach_goes_at_once_and_a_time_trigger_names_a_step_ahead():
    sched = Schedule(specs({"at_step": [2, 3, 9], "action": "spike"}))
    # Before the first step (the ranks said hello, step 1 not begun): those in reach of step 0.
    assert [(f.point["step"], f.at_step) for f in sched.due(facts(None))] == [(2, 2), (3, 3)]
    sched = Schedule(specs({"at_step": POINTS, "action": "nan"}))
    assert [f.at_step for f in sched.due(facts(10))] == list(range(5, 15))  # past ones too
    (f,) = Schedule(specs({"at_s": [0.5], "action": "nan"})).due(facts(7))
    assert f.at_step == 7 + AHEAD_STEPS
    (f,) = Schedule(specs({"at_step": 5, "action": "kill"})).due(facts(5))
    assert f.at_step is None  # other actions: as before


def test_a_point_given_back_goes_to_the_next_attempt():
    sched = Schedule(specs({"at_step": [6, 8], "action": "nan"}))
    first = sched.due(facts(4))  # attempt 0 reaches step 4: both sent ahead
    assert [f.at_step for f in first] == [6, 8]
    for f in first:  # attempt 0 ended at step 5: neither acted on
        sched.give_back(0, f.point)
    # Before attempt 1's first step, from step 4 (it resumes at or before): both go again,
    # held by the rank for their steps (sent once the resume's first step was seen, step 6
    # would come late from a checkpoint of step 5).
    assert [f.at_step for f in sched.due(facts(None, attempt=1))] == [6, 8]
    assert sched.due(facts(2, attempt=1)) == []
    every = Schedule(specs({"every_steps": 3, "action": "spike"}))
    assert [f.at_step for f in every.due(facts(5))] == [3, 6, 9]
    every.give_back(0, {"step": 6})  # 3 and 9 acted on, 6 not
    assert [f.at_step for f in every.due(facts(5, attempt=1))] == [6]  # 9 went already
    assert [f.at_step for f in every.due(facts(8, attempt=1))] == [12]


@pytest.mark.parametrize("gate", [{"after_checkpoint": True}, {"during": "save"}])
def test_a_nan_or_spike_behind_a_checkpoint_gate_is_refused(gate):
    with pytest.raises(ConfigError, match="acts at its very step"):
        specs({"at_step": 10, "action": "nan", **gate})


def pending(ranks=(1,), step=7, attempt=0, n=1) -> Pending:
    fields = {"name": "nans", "action": "nan", "point": {"step": step}, "ranks": list(ranks),
              "pids": [100 + r for r in ranks], "hosts": ["h"] * len(ranks),
              "steps": [3] * len(ranks), "phases": ["train"] * len(ranks),
              "via": ["control"] * len(ranks), "step": 3}  # fmt: skip
    return Pending((attempt, 0, n), fields, step, 12.5, set(ranks))


def ack(step, applied=True, at=None, fault=0):
    return {"fault": fault, "step": step, "action": "nan", "applied": applied,
            "at": step if at is None else at}  # fmt: skip


def test_the_ledger_turns_the_ranks_words_into_one_event_each():
    led = InFlight()
    assert led.hold(pending(ranks=(0, 1))) == []
    assert led.acked(0, 1, ack(7)) == []  # rank 0 has not said yet
    assert led.acked(0, 1, ack(8)) == []  # another point's word
    (done,) = led.acked(0, 0, ack(7, applied=False, at=8))
    (fault, fields), (lost, why) = events(done)
    assert (fault, fields["ranks"], fields["steps"], fields["pids"]) == ("fault", [1], [7], [101])
    assert (fields["step"], fields["sent_step"], fields["sent_mono"]) == (7, 3, 12.5)
    assert (lost, why["ranks"], why["step"]) == ("fault_undelivered", [0], 7)
    assert why["errors"] == ["rank 0: it came when the rank was at step 8, past 7"]


def test_an_attempts_end_gives_back_what_no_rank_reached_and_the_jobs_end_lays_the_rest():
    led = InFlight()
    led.hold(untouched := pending(step=9))
    led.hold(half := pending(ranks=(0, 1), step=8, n=2))
    led.acked(0, 0, ack(8))
    led.hold(later := pending(step=30, attempt=1, n=3))
    back, resolved = led.attempt_over(1)
    assert back == [untouched] and resolved == [half]
    assert half.failed == {1: "attempt 0 ended before the rank acted on it"}
    assert [p.key for p in led.close()] == [later.key]
    assert later.failed == {1: "the job ended before the rank acted on it"}


class Recorded:
    """A control channel that keeps what was sent (the engine only sends)."""

    def __init__(self):
        self.sent = []

    def send(self, attempt, rank, command):
        self.sent.append((attempt, rank, command["action"], command["step"]))

    def close(self):
        pass


def table(attempt: int, step: int) -> AttemptTable:
    t = AttemptTable(attempt=attempt, world=2, launched_at=0.0)
    for r in (0, 1):
        msg = {"attempt": attempt, "rank": r, "world": 2, "host": "h", "pid": 10 + r, "t": 0.0}
        t.update({**msg, "kind": "hello", "phase": "init"}, 0.0)
        t.update({**msg, "kind": "step", "step": step, "loss": 1.0, "dt": 0.1}, 0.0)
    return t


def test_the_engine_writes_a_fault_event_only_once_the_rank_acted():
    said, control = [], Recorded()
    engine = FaultEngine(
        specs({"at_step": [6, 7], "action": "nan", "target": "rank:1"}), job_id="j", world=2,
        ranks_per_node=2, ckpt_dir=None, this_host="h", control=control,
        emit=lambda e, **kw: said.append((e, kw)),
    )  # fmt: skip
    engine.attempt_started(0)
    engine.fire_due(t0 := table(0, 3), 1.0)
    assert control.sent == [(0, 1, "nan", 6), (0, 1, "nan", 7)] and said == []  # none done yet
    msg = {"kind": "fault_ack", "attempt": 0, "rank": 1, **ack(6)}
    engine.on_message(msg, t0, 1.0)
    ((event, fields),) = said
    assert (event, fields["steps"], fields["ranks"], fields["total"]) == ("fault", [6], [1], 1)
    engine.attempt_over()  # attempt 0 ends at step 6: point 7 never reached, so given back
    engine.attempt_started(1)
    engine.fire_due(table(1, 3), 2.0)
    assert control.sent[-1] == (1, 1, "nan", 7) and len(said) == 1
    engine.close()
    assert said[-2][0] == "fault_undelivered" and said[-2][1]["attempt"] == 1
    assert said[-1] == ("fault_summary", {"total": 1, "fired": {"faults[0]": 1}})

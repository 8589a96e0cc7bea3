"""The numerical guard on the supervisor's side: [guard] to worker flags, the `nan` and `spike`
faults and their control commands, the guard's messages to events, and the report's table."""

from __future__ import annotations

import math

import pytest

from contracts import control_msgs, messages
from contracts.config_table import ConfigError
from faults.delivery import Delivery
from faults.spec import JobShape, parse_all
from supervisor.reporting.guard_md import guard_line, guard_md, guard_rows
from supervisor.settings.loading import from_dict
from supervisor.watch.rank_table import AttemptTable
from tests.support import BEACON_JOB as JOB
from tests.support import BEACON_KEY as KEY
from worker.beat import Beacon
from worker.guard import Injected
from worker.step_commands import StepFaults

SHAPE = JobShape(train_iters=100, save_interval=10, world=2, nodes=1, ranks_per_node=2)


def config(**tables):
    return from_dict({"worker": {"train_iters": 100}, **tables}, "job.toml")


def test_guard_keys_become_worker_flags_only_where_they_differ_from_its_defaults():
    assert not any(f.startswith("--guard") for f in config().worker_flags())
    cfg = config(guard={"action": "rollback", "skip_batches": 8, "factor": 4.0})
    flags = cfg.worker_flags()
    assert flags[flags.index("--guard") + 1] == "rollback"
    assert flags[flags.index("--guard-skip-batches") + 1] == "8"
    assert "--guard-factor" not in flags


@pytest.mark.parametrize(
    ("table", "worker", "key", "said"),
    [
        ({"factor": 1.0}, {}, "guard.factor", "expected a number above 1"),
        ({"grad_factor": math.inf}, {}, "guard.grad_factor", "expected a number above 1"),
        ({"warmup": 0}, {}, "guard.warmup", "expected 1 or more"),
        ({"skip_batches": 2 * 10**9}, {}, "guard.skip_batches", "expected at most 10^9"),
        ({"action": "ignore"}, {}, "guard.action", "expected one of 'off' | 'skip'"),
        ({"action": "off"}, {"guard": "skip"}, "worker.guard", "set twice"),
    ],
)
def test_bad_guard_values_are_one_clear_error(table, worker, key, said):
    with pytest.raises(ConfigError) as caught:
        from_dict({"worker": {"train_iters": 100, **worker}, "guard": table}, "job.toml")
    assert caught.value.key == key and said in str(caught.value)


def test_nan_and_spike_faults_parse_and_need_the_guard():
    nan, spike = parse_all(
        [{"at_step": 5, "action": "nan", "target": "rank:1"}, {"at_step": 6, "action": "spike"}],
        "job.toml",
        SHAPE,
    )
    assert (nan.action.kind, spike.action.kind, spike.action.factor) == ("nan", "spike", 100.0)
    with pytest.raises(ConfigError, match="factor"):
        parse_all([{"at_step": 5, "action": "spike", "factor": 0.5}], "job.toml", SHAPE)
    with pytest.raises(ConfigError, match="does not apply"):
        parse_all([{"at_step": 5, "action": "nan", "factor": 3}], "job.toml", SHAPE)
    off = JobShape(train_iters=100, save_interval=10, guard="off")
    with pytest.raises(ConfigError, match="numerical guard"):
        parse_all([{"at_step": 5, "action": "nan"}], "job.toml", off)
    with pytest.raises(ConfigError, match="numerical guard"):
        from_dict({"worker": {"train_iters": 100, "save_interval": 10}, "guard": {"action": "off"},
                   "faults": [{"at_step": 5, "action": "spike"}]}, "job.toml")  # fmt: skip


class _Channel:
    def __init__(self):
        self.sent = []

    def send(self, attempt, rank, command):
        self.sent.append(command)
        return None


class _Rank:
    def __init__(self, rank, step):
        self.rank, self.step, self.host, self.pid, self.exited, self.phase = (
            rank, step, "elsewhere", 1, False, "train",
        )  # fmt: skip


def test_a_spike_command_names_its_own_step_and_round_trips_signed():
    """Issue 40: the command named the rank's next step as the supervisor last saw it (a rank
    other than 0 says its step once a beat: often a stale one), so it landed anywhere."""
    (spec,) = parse_all([{"at_step": 12, "action": "spike", "factor": 8}], "job.toml", SHAPE)
    channel = _Channel()
    delivery = Delivery(channel, JOB, "here", lambda *a, **k: None)
    delivery.deliver(spec, 1, 0, [_Rank(1, 7)], 0.0, at_step=12)
    (cmd,) = channel.sent
    assert (cmd["action"], cmd["step"], cmd["factor"]) == ("spike", 12, 8.0)
    frame = messages.encode(KEY.encode(), cmd)
    assert control_msgs.decode_control(KEY.encode(), frame, JOB, 0, 1) == cmd


class _Told(Beacon):
    def __init__(self, cmds):
        self.cmds = cmds

    def commands(self):
        out, self.cmds = self.cmds, []
        return out


def test_step_faults_hand_nan_and_spike_to_the_guard():
    told = control_msgs.control_message
    cmds = [
        told(JOB, 0, 1, 0.0, "nan", 1, step=9),
        told(JOB, 0, 1, 0.0, "spike", 2, step=4, factor=50),
    ]
    faults = StepFaults(_Told(cmds))
    faults.apply()
    assert faults.numeric() == [Injected(9, "nan", 1.0, 1), Injected(4, "spike", 50.0, 2)]
    assert faults.numeric() == []


def test_guard_messages_become_one_event_each_from_rank_0_only():
    t = AttemptTable(attempt=0, world=2, launched_at=0.0)
    zero, one = (messages.RankIdentity(JOB, 0, r, 2, "h", 7) for r in (0, 1))
    fault = {"step": 7, "ranks": [1], "fault": "nan", "value": "nan", "what": "grad_norm",
             "action": "rollback"}  # fmt: skip
    for ident in (zero, one):
        messages.validate(ident.message("numeric_fault", 1.0, **fault))
    assert t.update(one.message("numeric_fault", 1.0, **fault), 1.0) == []
    (ev,) = t.update(zero.message("numeric_fault", 1.0, **fault), 1.0)
    assert (ev.event, ev.fields) == ("numeric_fault", {
        "step": 7, "ranks": [1], "kind": "nan", "value": "nan", "what": "grad_norm",
        "action": "rollback"})  # fmt: skip
    (ev,) = t.update(zero.message("rollback", 1.0, from_step=7, to_step=4, skip="5-9"), 1.0)
    assert ev.fields == {"from_step": 7, "to_step": 4, "skip": "5-9"}
    with pytest.raises(messages.BadMessage, match="unknown numeric fault"):
        messages.validate(zero.message("numeric_fault", 1.0, **{**fault, "fault": "odd"}))


def test_the_report_lists_faults_and_rollbacks_and_says_nothing_for_a_healthy_run():
    events = [
        {"event": "start", "ts": 100.0},
        {"event": "numeric_fault", "ts": 130.0, "attempt": 0, "step": 7, "ranks": [1],
         "kind": "spike", "value": 123.456789, "what": "loss", "action": "rollback"},
        {"event": "rollback", "ts": 131.0, "attempt": 0, "from_step": 7, "to_step": 4,
         "skip": "5-9"},
    ]  # fmt: skip
    lines = guard_md(guard_rows(events, 100.0))
    assert lines[2] == "| 0.50 | 0 | numeric_fault | 7 | spike | 123.457 | 1 | rollback |"
    assert lines[3] == "| 0.52 | 0 | rollback | 7 | rollback | – | – | to step 4, skip 5-9 |"
    assert lines[-1] == "1 bad step(s) caught and not applied; 1 rollback(s)."
    assert guard_md(guard_rows(events[:1], 100.0)) == []
    said = guard_line(guard_rows(events, 100.0))
    assert said == "Numerical guard: 1 bad step(s) not applied (step 7 spike), 1 rollback(s)."
    assert guard_line([]) is None

"""The supervisor's keeper of "auto" intervals (supervisor.run.intervals) with real sockets: rank
0's step messages bring costs and step times, a decision is an `interval_changed` event and a
signed `interval` command that reaches rank 0's real control channel (a beacon) and its
per-step hook; a failure is decided on again and told to a standby at once; a launch after it
starts with the interval; a command that found no rank is sent again with its next step. And
the report's interval over time. No rank processes: the keeper is fed the messages a rank 0
sends.
"""

from __future__ import annotations

import os
import time

import zmq

from contracts import intervals, messages
from contracts.env_names import ENV_MEM_CKPT_INTERVAL
from supervisor.policy.restarts import AttemptRecord
from supervisor.reporting.analysis import analyze
from supervisor.reporting.load import load_run
from supervisor.reporting.plot import plot
from supervisor.reporting.report_md import render
from supervisor.run.intervals import AutoTiers, IntervalKeeper, auto_tiers
from supervisor.settings.loading import from_dict
from supervisor.watch.control import ControlServer
from tests.support import ev, synthetic_events, synthetic_metrics, write_run
from worker.beat import ZmqBeacon
from worker.step_commands import StepFaults

KEY = b"k" * 32
PRIOR = 100.0


def step(attempt: int, n: int, dt: float = 0.1, **cost: float) -> dict:
    msg = {"kind": "step", "rank": 0, "attempt": attempt, "step": n, "dt": dt, "loss": 1.0}
    return {**msg, "cost": cost} if cost else msg


class Rank0:
    """Rank 0 of an attempt: a real beacon with its control channel, and its per-step hook."""

    def __init__(self, server: ControlServer, attempt: int) -> None:
        self.pull = zmq.Context.instance().socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        ident = messages.RankIdentity("job", attempt, 0, 2, "h", os.getpid())
        self.beacon = ZmqBeacon(f"tcp://127.0.0.1:{port}", KEY, ident, 0.05, server.address)
        self.hook = StepFaults(self.beacon)

    def told(self, keeper: IntervalKeeper, attempt: int, at: int) -> list[tuple[str, int, int]]:
        """What reached it, the keeper given rank 0's next step messages meanwhile (a command
        that found no rank yet is sent again with one)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.hook.apply()
            got = self.hook.intervals()
            if got:
                return got
            keeper.on_message(step(attempt, at))
            time.sleep(0.02)
        raise AssertionError("no interval command reached the rank")

    def close(self) -> None:
        self.beacon.close()
        self.pull.close(0)


def test_costs_and_failures_become_events_and_commands_to_rank_0():
    server = ControlServer(KEY, "job", "127.0.0.1", "127.0.0.1")
    events: list[tuple[str, dict]] = []
    now = [0.0]
    keeper = IntervalKeeper(
        AutoTiers((intervals.MEMORY,), PRIOR, 1000), "job", server,
        lambda event, **f: events.append((event, f)), clock=lambda: now[0],
    )  # fmt: skip
    assert keeper.rank_env(0, standby=False) == {}  # nothing decided: the ranks tune themselves
    first = Rank0(server, 0)
    standby = None
    try:
        for n in range(1, 6):
            keeper.on_message(step(0, n))  # step 1 is start-up: 4 step times of 0.1 s
        keeper.on_message(step(0, 6, memory=0.02))
        want = intervals.interval_steps(0.02, 0.1, PRIOR, 1000)  # no failure yet: the prior
        ((name, fields),) = events
        assert name == "interval_changed"
        assert (fields["tier"], fields["old"], fields["new"], fields["why"]) == (
            "memory",
            None,
            want,
            "cost",
        )
        assert (fields["cost_s"], fields["step_s"], fields["mtbf_s"]) == (0.02, 0.1, PRIOR)
        assert fields["failures"] == 0 and fields["prior_mtbf_s"] == PRIOR
        ((tier, every, from_step),) = first.told(keeper, 0, 7)
        assert (tier, every) == ("memory", want) and from_step >= 6 + 2

        standby = Rank0(server, 1)
        env = keeper.rank_env(1, standby=True)
        deadline = time.monotonic() + 10  # a standby connects long before it is needed
        while server.command(1, 0, "exit", time.time()) is not None:  # (a standby's word)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert env == {ENV_MEM_CKPT_INTERVAL: str(want)}
        keeper.attempt_ended(AttemptRecord(0, 0, None, "failure"))  # never stepped: not counted
        assert len(events) == 1 and keeper.failures == []
        now[0] = 10.0
        keeper.attempt_ended(AttemptRecord(0, 0, 7, "failure"))
        name, fields = events[-1]
        mtbf = 10.0  # the prior is gone with the first failure: 10 s since the first step
        assert (name, fields["why"], fields["failures"], fields["mtbf_s"]) == (
            "interval_changed",
            "failure",
            1,
            mtbf,
        )
        shorter = intervals.interval_steps(0.02, 0.1, mtbf, 1000)
        assert fields["old"] == want and fields["new"] == shorter < want
        # the standby is told at once, from its first step (a failed attempt is told nothing)
        assert "0" not in fields["to"]
        ((tier, every, from_step),) = standby.told(keeper, 1, 8)
        assert (tier, every, from_step) == ("memory", shorter, 0)
        assert keeper.rank_env(2, standby=False) == {ENV_MEM_CKPT_INTERVAL: str(shorter)}
        keeper.on_message(step(0, 9, memory=0.02))  # a straggler of the attempt that ended
        assert len(events) == 2
    finally:
        first.close()
        if standby is not None:
            standby.close()
        server.close()


def test_which_tiers_are_auto():
    cfg = from_dict({"worker": {"ckpt_dir": "/c", "train_iters": 50}})
    assert auto_tiers(cfg) == AutoTiers((intervals.MEMORY,), 3600.0, 50)  # the worker's default
    cfg = from_dict({"worker": {"ckpt_dir": "/c", "save_interval": "auto",
                                "mem_ckpt_interval": 2, "mtbf_prior_s": 60}})  # fmt: skip
    assert auto_tiers(cfg) == AutoTiers((intervals.DURABLE,), 60.0, 100)
    assert auto_tiers(from_dict({"worker": {"mem_ckpt_interval": 0}})) is None


def test_the_report_shows_the_interval_over_time(tmp_path):
    """Each `interval_changed` is a row of report.md and a step of the lower panel of report.png."""
    changed = [
        ev("interval_changed", 20.0, tier="memory", old=None, new=38, why="cost", cost_s=0.04,
           step_s=0.5, mtbf_s=3600.0, failures=0),
        ev("interval_changed", 36.0, tier="memory", old=38, new=9, why="failure", cost_s=0.04,
           step_s=0.5, mtbf_s=200.0, failures=1),
    ]  # fmt: skip
    events = sorted(synthetic_events() + changed, key=lambda e: e["mono"])
    run = write_run(tmp_path / "run", events, synthetic_metrics())
    a = analyze(load_run(run))
    assert [(r.t_s, r.tier, r.old, r.new, r.why) for r in a.intervals] == [
        (20.0, "memory", None, 38, "cost"),
        (36.0, "memory", 38, 9, "failure"),
    ]
    text = render(a)
    assert "## Checkpoint intervals" in text and "- memory: 2 decisions, in steps: 38 → 9" in text
    assert "| 0.60 | memory | 38 → 9 | failure | 0.0400 | 0.500 | 200.0 | 1 |" in text
    png = plot(a, tmp_path / "report.png")
    assert png.stat().st_size > 0


def test_a_cost_before_any_step_time_is_decided_on_once_the_step_times_come():
    """The first copy's cost comes with the run's second step, before there are step times to
    go by: the decision waits for them, not for the next cost."""
    server = ControlServer(KEY, "job", "127.0.0.1", "127.0.0.1")
    events: list[tuple[str, dict]] = []
    keeper = IntervalKeeper(AutoTiers((intervals.DURABLE,), PRIOR, 1000), "job", server,
                            lambda event, **f: events.append((event, f)))  # fmt: skip
    try:
        keeper.on_message(step(0, 1))
        keeper.on_message(step(0, 2, durable=0.3))
        keeper.on_message(step(0, 3))
        assert events == []  # 2 step times: not yet
        keeper.on_message(step(0, 4))
        ((name, fields),) = events
        assert (name, fields["why"], fields["old"], fields["to"]) == ("interval_changed", "cost",
                                                                       None, {})  # fmt: skip
        assert fields["new"] == intervals.interval_steps(0.3, 0.1, PRIOR, 1000)
        keeper.on_message(step(0, 5))
        assert len(events) == 1
    finally:
        server.close()

"""Limits learned from the run (issue 17): `"auto"` progress limits and liveness timeout.

The derivation is pure (`limits.auto_*`, `limit_changed`, `judge_ranks` with `Limits`); the
samples it is fed come from an attempt's own messages (`auto_limits.Learner`, through
`AttemptTable.update` with plain messages and clock values)."""

from __future__ import annotations

import tomllib

import pytest

from contracts import messages
from supervisor.commands import status
from supervisor.policy import limits
from supervisor.policy.limits import Limits
from supervisor.policy.liveness import RankState, judge_ranks
from supervisor.settings import config as C
from supervisor.settings import loading, toml_dump
from supervisor.settings.config import AutoMaxConfig, HeartbeatConfig, ProgressConfig
from supervisor.watch.rank_table import AttemptTable

HB = HeartbeatConfig(interval_s=0.5, timeout_s=4.0, progress=ProgressConfig(train="auto"))
JOB = "job-1"


# --- the pure derivation --------------------------------------------------------------------------
def test_quantile_is_nearest_rank():
    xs = [float(i) for i in range(1, 101)]
    assert limits.quantile(xs, 0.99) == 99.0 and limits.quantile(xs, 1.0) == 100.0
    assert limits.quantile(xs, 0.5) == 50.0 and limits.quantile([3.0], 0.99) == 3.0


def test_train_limit_is_a_multiple_of_the_p99_step_plus_a_beat_gap():
    steps = [0.1] * 98 + [0.3, 0.4]  # p99: 0.3
    beats = [0.5] * 99 + [0.6]  # p99: 0.5
    value, basis = limits.auto_train_limit(steps, beats, interval_s=0.5, max_s=120)
    assert value == pytest.approx(4 * 0.3 + 0.5)
    assert basis["p99_step_s"] == 0.3 and basis["p99_beat_gap_s"] == 0.5
    assert basis["samples"] == 100 and basis["max_s"] == 120


def test_train_limit_needs_samples_and_stays_between_its_floor_and_its_maximum():
    rule = limits.TRAIN_RULE
    few = [0.05] * (rule.min_samples - 1)
    assert limits.auto_train_limit(few, [0.5] * 50, 0.5, 120) is None
    fast = [0.01] * rule.min_samples
    assert limits.auto_train_limit(fast, [0.1] * 50, 0.1, 120)[0] == rule.floor_s
    assert limits.auto_train_limit(fast, [2.0] * 50, 2.0, 120)[0] == 4.0  # >= 2 beat intervals
    slow = [5.0] * rule.min_samples
    assert limits.auto_train_limit(slow, [1.0] * 50, 1.0, 8.0)[0] == 8.0
    # No beat gap seen yet: one beat interval stands in for it.
    assert limits.auto_train_limit([0.5] * 30, [], 0.5, 120)[0] == pytest.approx(2.5)


def test_timeout_is_a_multiple_of_the_p99_beat_gap_within_floor_and_maximum():
    assert limits.auto_timeout([0.5] * (limits.TIMEOUT_RULE.min_samples - 1), 0.5, 10) is None
    value, basis = limits.auto_timeout([0.5] * 100 + [0.7], 0.5, 10)
    assert value == pytest.approx(2.0) and basis["p99_beat_gap_s"] == 0.5  # the 2 s floor
    assert limits.auto_timeout([0.5] * 99 + [0.9, 0.9], 0.5, 10)[0] == pytest.approx(2.7)
    assert limits.auto_timeout([0.1] * 50, 0.1, 10)[0] == limits.TIMEOUT_RULE.floor_s
    assert limits.auto_timeout([1.0] * 50, 1.0, 10)[0] == 3.0  # 3 x p99, and >= 3 intervals
    assert limits.auto_timeout([1.1] * 50, 1.0, 10)[0] == pytest.approx(3.3)
    # Under relays a rank's own beat may be a summary interval older than the summary.
    value, basis = limits.auto_timeout([1.1] * 50, 1.0, 10, relayed=True)
    assert value == pytest.approx(4.3) and basis["relay_slack_s"] == 1.0
    assert limits.auto_timeout([5.0] * 50, 1.0, 10)[0] == 10  # never above the maximum


def test_save_limit_is_a_multiple_of_the_longest_save():
    assert limits.auto_save_limit([0.5], 600) is None
    assert limits.auto_save_limit([0.5, 4.0], 600)[0] == 16.0
    assert limits.auto_save_limit([0.1, 0.2], 600)[0] == limits.SAVE_RULE.floor_s
    assert limits.auto_save_limit([300.0, 10.0], 600)[0] == 600


def test_a_limit_changes_only_meaningfully_rising_sooner_than_falling():
    assert not limits.limit_changed(2.0, 2.15)  # +7.5 %
    assert limits.limit_changed(2.0, 2.2)  # +10 %
    assert not limits.limit_changed(0.5, 0.55)  # +10 % but under 0.1 s
    assert not limits.limit_changed(2.0, 1.6)  # -20 %
    assert limits.limit_changed(2.0, 1.5)  # -25 %
    assert not limits.limit_changed(0.6, 0.45)  # -25 % but under 0.2 s


def test_fixed_limits_put_every_auto_at_its_maximum():
    hb = HeartbeatConfig(
        timeout_s="auto",
        progress=ProgressConfig(train="auto", save="auto", init=50),
        auto_max=AutoMaxConfig(timeout_s=7, train=30, save=90),
    )
    lim = limits.fixed_limits(hb)
    assert lim.timeout_s == 7 and lim.train_timeout_s is None and lim.learned == frozenset()
    assert lim.progress == {"init": 50, "load": 300, "train": 30, "save": 90}


# --- judging with learned limits ------------------------------------------------------------------
def rank(r, seen, progress, phase="train", step=5):
    return RankState(rank=r, last_seen=seen, last_progress=progress, phase=phase, step=step)


LEARNED = Limits(
    timeout_s=10.0,
    progress={"init": 60, "load": 60, "train": 1.6, "save": 60},
    train_timeout_s=2.5,
    learned=frozenset({"train", "timeout_s"}),
)


def test_a_learned_train_limit_finds_a_stall_and_says_it_is_auto():
    ranks = {0: rank(0, 100.0, 98.0), 1: rank(1, 99.9, 98.5)}
    f = judge_ranks(ranks, 2, now=100.0, launched_at=0, heartbeat=HB, limits=LEARNED)
    assert f.kind == "no_progress" and f.ranks == (0,) and f.deadline == pytest.approx(99.6)
    assert "(timeout 1.6 s, auto)" in f.reason
    # The same ranks under the config's own limits (auto: its maximum) are fine.
    assert judge_ranks(ranks, 2, now=100.0, launched_at=0, heartbeat=HB) is None


def test_the_learned_liveness_timeout_holds_only_while_training():
    ranks = {0: rank(0, 97.0, 97.0, phase="save"), 1: rank(1, 100.0, 100.0)}
    assert judge_ranks(ranks, 2, now=100.0, launched_at=0, heartbeat=HB, limits=LEARNED) is None
    ranks[0] = rank(0, 97.0, 97.0)  # the same silence in train: past its 2.5 s
    f = judge_ranks(ranks, 2, now=100.0, launched_at=0, heartbeat=HB, limits=LEARNED)
    assert f.kind == "hang" and f.deadline == pytest.approx(99.5)
    assert "(timeout 2.5 s, auto)" in f.reason


# --- learning from an attempt's messages ----------------------------------------------------------
class Ranks:
    """Plain messages of two ranks into one table, on a clock the test moves."""

    def __init__(self, hb: HeartbeatConfig = HB):
        self.t = AttemptTable(attempt=1, world=2, launched_at=0.0, heartbeat=hb)
        self.msg = [messages.RankIdentity(JOB, 1, r, 2, "h", 10 + r).message for r in (0, 1)]
        self.notes: list = []

    def send(self, rank: int, kind: str, now: float, **fields) -> None:
        self.notes += self.t.update(self.msg[rank](kind, now, **fields), now)

    def auto(self, name: str) -> list[dict]:
        return [
            n.fields for n in self.notes if n.event == "auto_limit" and n.fields["limit"] == name
        ]


def train(r: Ranks, start: float, steps: range, dt: float, beat_every: float = 0.5) -> float:
    """Rank 0 steps every `dt` (a step message each), both ranks beat every `beat_every`."""
    now, next_beat = start, start
    for step in steps:
        now += dt
        r.send(0, "step", now, step=step, loss=1.0, dt=dt)
        while next_beat <= now:
            for rank in (0, 1):
                r.send(rank, "beat", next_beat, phase="train", step=step)
            next_beat += beat_every
    return now


def test_an_attempt_learns_its_train_limit_after_its_warm_up_and_says_so_once():
    r = Ranks()
    for rank in (0, 1):
        r.send(rank, "hello", 0.0, phase="init")
        r.send(rank, "phase", 1.0, phase="train", step=0)
    assert r.t.limits.progress["train"] == 120  # its maximum until learned
    # Slow first steps (the warm-up) are no samples: learned from the 0.1 s steps only.
    now = train(r, 1.0, range(1, limits.WARMUP_STEPS + 1), dt=3.0)
    assert r.auto("train") == []
    now = train(r, now, range(limits.WARMUP_STEPS + 1, 60), dt=0.1)
    (said,) = r.auto("train")
    # 4 x 0.1 s + a 0.5 s beat gap is under the floor: the floor.
    assert said["seconds"] == limits.TRAIN_RULE.floor_s and said["previous_s"] == 120
    assert said["p99_step_s"] == pytest.approx(0.1) and said["p99_beat_gap_s"] == 0.5
    assert r.t.limits.progress["train"] == limits.TRAIN_RULE.floor_s
    assert "train" in r.t.limits.learned
    # More of the same: no new event; a slower machine: the limit follows, said once.
    now = train(r, now, range(60, 120), dt=0.1)
    assert len(r.auto("train")) == 1
    now = train(r, now, range(120, 160), dt=0.4)
    assert len(r.auto("train")) == 2 and r.auto("train")[-1]["seconds"] == pytest.approx(2.1)


def test_saves_and_the_liveness_timeout_are_learned_too():
    hb = HeartbeatConfig(
        interval_s=0.5,
        timeout_s="auto",
        progress=ProgressConfig(train=8, save="auto"),
    )
    r = Ranks(hb)
    for rank in (0, 1):
        r.send(rank, "phase", 0.0, phase="train", step=0)
    now = train(r, 0.0, range(1, 60), dt=0.1)
    for step in (60, 70):
        for rank in (0, 1):
            r.send(rank, "phase", now, phase="save", step=step)
        # A save of 3 s; its beats (1.5 s apart: a save may hold the GIL) are no samples.
        for beat in (1.5, 3.0):
            for rank in (0, 1):
                r.send(rank, "beat", now + beat, phase="save", step=step)
        now += 3.0
        for rank in (0, 1):
            r.send(rank, "phase", now, phase="train", step=step)
        now = train(r, now, range(step + 1, step + 10), dt=0.1)
    (save,) = r.auto("save")
    assert save["seconds"] == pytest.approx(12.0) and save["samples"] == 2
    (timeout,) = r.auto("timeout_s")
    assert timeout["seconds"] == pytest.approx(2.0) and timeout["previous_s"] == 10
    lim = r.t.limits
    assert lim.train_timeout_s == pytest.approx(2.0) and lim.timeout_s == 10
    assert lim.progress["train"] == 8 and lim.learned == {"save", "timeout_s"}


def test_a_table_without_auto_limits_learns_nothing():
    fixed = HeartbeatConfig(timeout_s=10.0)
    t = AttemptTable(attempt=1, world=2, launched_at=0.0, heartbeat=fixed)
    assert t.learner is None and t.limits is None


def test_the_liveness_timeout_is_learned_by_default():
    t = AttemptTable(attempt=1, world=2, launched_at=0.0, heartbeat=HeartbeatConfig())
    assert t.learner is not None and t.limits.timeout_s == 10.0


# --- config and status ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, key, message",
    [
        ('[heartbeat.progress]\ntrain = "fast"\n', "heartbeat.progress.train", 'or "auto"'),
        ('[heartbeat.progress]\ninit = "auto"\n', "heartbeat.progress.init", "is for train and"),
        ('[heartbeat]\ntimeout_s = "Auto"\n', "heartbeat.timeout_s", 'a number or "auto"'),
        ("[heartbeat.progress]\ntrain = 0\n", "heartbeat.progress.train", '"auto" or seconds'),
        ("[heartbeat.auto_max]\ntrain = 0.1\n", "heartbeat.auto_max.train", "seconds > interval"),
        ("[heartbeat.auto_max]\ntimeout_s = 1\n", "heartbeat.auto_max.timeout_s", "twice"),
    ],
)
def test_auto_values_are_checked(tmp_path, text, key, message):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(C.ConfigError) as err:
        loading.load(path)
    assert err.value.key == key and message in err.value.message


def test_auto_values_load_and_dump(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[heartbeat]\ntimeout_s = "auto"\n[heartbeat.progress]\ntrain = "auto"\n')
    cfg = loading.load(path)
    assert cfg.heartbeat.timeout_s == "auto" and cfg.heartbeat.progress.train == "auto"
    assert cfg.heartbeat.progress.save == 600.0
    data = toml_dump.to_dict(cfg)
    assert loading.from_dict(tomllib.loads(toml_dump.dumps(data))).heartbeat.timeout_s == "auto"


def test_status_shows_the_auto_limits_in_force():
    resolved = {"heartbeat": {"timeout_s": "auto", "progress": {"train": "auto", "save": 60}}}
    events = [
        {"event": "launch", "attempt": 0},
        {"event": "auto_limit", "attempt": 0, "limit": "train", "seconds": 3.0},
        {"event": "launch", "attempt": 1},
        {"event": "auto_limit", "attempt": 1, "limit": "train", "seconds": 1.53,
         "p99_step_s": 0.12, "p99_beat_gap_s": 0.52, "samples": 180},
    ]  # fmt: skip
    lines = status.limits_lines(events, resolved)
    assert lines[0] == ("limits:   timeout_s 10 s (auto: its maximum until learned)") and lines[
        1
    ].strip() == (
        "train 1.53 s (auto, phase train; from p99_step_s 0.12, p99_beat_gap_s 0.52, samples 180)"
    )
    assert status.limits_lines(events, {"heartbeat": {"timeout_s": 4}}) == []

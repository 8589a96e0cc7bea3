"""Stragglers, the pure parts: the score and its window, one finding per episode and node, the
response to a finding, the supervisor's observations from beats, steps and relay summaries, the
messages' optional compute and wait (validated, old senders accepted) and the relay's summary
that carries them, and the `[stragglers]` config's checks."""

from __future__ import annotations

import random
import time

import pytest

from contracts import messages
from contracts.config_table import ConfigError
from supervisor.policy.stragglers import StragglerScore, respond, scores, window_score
from supervisor.settings.loading import from_dict
from supervisor.watch.step_times import StepTimes
from tests.support import BEACON_JOB as JOB
from tests.support import BEACON_KEY as KEY
from worker.relay import RelayCore
from worker.step_clock import StepClock

K = KEY.encode()
NODES = ["n0", "n1", "n2", "n3"]


def node_of(rank: int) -> str:
    return NODES[rank]


def healthy(rng: random.Random, ranks: int = 4) -> dict[int, float]:
    """One observation of a busy shared host: every rank's compute 30-125 ms (as measured)."""
    return {r: rng.uniform(0.030, 0.125) for r in range(ranks)}


def test_the_score_is_compute_over_the_median():
    s = scores({0: 0.1, 1: 0.1, 2: 0.3, 3: 0.1})
    assert s == {0: 1.0, 1: 1.0, 2: pytest.approx(3.0), 3: 1.0}
    assert scores({0: 0.1}) == {}  # one rank has nothing to be slow against
    assert scores({0: 0.0, 1: 0.0}) == {0: 0.0, 1: 0.0}  # no division by nothing


def test_the_window_score_waits_for_a_full_window():
    assert window_score([2.0, 2.0], 3) is None
    assert window_score([9.0, 1.0, 2.0, 2.0], 3) == 2.0  # the last three's median


def test_no_finding_over_many_noisy_healthy_observations():
    rng = random.Random(7)
    score = StragglerScore(threshold=1.6, window=10)
    found = [f for i in range(3000) for f in score.observe(i, healthy(rng), node_of)]
    assert found == []


def test_a_slow_rank_is_named_with_its_node_within_its_window():
    rng = random.Random(3)
    score = StragglerScore(threshold=1.6, window=10)
    for i in range(50):
        assert score.observe(i, healthy(rng), node_of) == []
    found = []
    for i in range(50, 80):
        obs = healthy(rng)
        obs[2] += 0.135  # half a step of ~270 ms
        found += [(i, f) for f in score.observe(i, obs, node_of)]
    (at, finding), *more = found
    assert not more  # one event for the episode
    assert at < 50 + 10
    assert (finding.ranks, finding.node, finding.window) == ((2,), "n2", 10)
    assert finding.score > 1.6 and finding.step == at
    assert finding.fields()["node"] == "n2"


def test_an_episode_is_re_armed_once_the_rank_recovers():
    score = StragglerScore(threshold=1.5, window=3)
    slow = {0: 0.1, 1: 0.1, 2: 0.3}
    well = {0: 0.1, 1: 0.1, 2: 0.1}
    found = [len(score.observe(i, slow if i % 20 < 10 else well, node_of)) for i in range(40)]
    assert sum(found) == 2 and found[2] == 1 and found[21] == 1


def test_a_node_s_slow_ranks_are_one_finding():
    score = StragglerScore(threshold=1.5, window=2)
    obs = {0: 0.1, 1: 0.1, 2: 0.1, 3: 0.1, 4: 0.3, 5: 0.3}
    found = []
    for i in range(3):
        found += score.observe(i, obs, lambda r: f"n{r // 2}")
    (finding,) = found
    assert finding.ranks == (4, 5) and finding.node == "n2"


@pytest.mark.parametrize(
    ("action", "spares", "shrink", "active", "pending", "replace", "said"),
    [
        ("report", 1, False, 4, False, False, "reported"),
        ("replace", 1, False, 4, False, True, "a spare takes"),
        ("replace", 0, True, 4, False, True, "excluded (shrink)"),
        ("replace", 0, True, 1, False, False, "reported only"),
        ("replace", 0, False, 4, False, False, "reported only: no spare"),
        ("replace", 1, False, 4, True, False, "already pending"),
    ],
)
def test_the_response_to_a_finding(action, spares, shrink, active, pending, replace, said):
    r = respond(action, spares, shrink, active, 1, pending)
    assert r.replace is replace and said in r.said


# --- what the supervisor observes -----------------------------------------------------------------
def msg(kind: str, rank: int, step: int, **fields) -> dict:
    ident = messages.RankIdentity(JOB, 0, rank, 4, "h", 1)
    return ident.message(kind, 0.0, step=step, **fields)


def test_an_observation_once_every_rank_said_a_newer_step():
    times = StepTimes(3)
    times.take(msg("beat", 0, 5, phase="train", compute=0.1, wait=0.2))
    times.take(msg("step", 1, 5, loss=1.0, dt=0.3, compute=0.2))
    times.take(msg("beat", 2, 5, phase="train"))  # an old sender: no compute
    assert times.observations() == []
    times.take(msg("beat", 2, 6, phase="train", compute=0.3))
    assert times.observations() == [(6, {0: 0.1, 1: 0.2, 2: 0.3})]
    times.take(msg("step", 0, 7, loss=1.0, dt=0.3, compute=0.1))
    assert times.observations() == []  # ranks 1 and 2 said nothing past step 6 yet
    times.take(msg("beat", 1, 7, phase="train", compute=0.2))
    times.take(msg("beat", 2, 7, phase="train", compute=0.3))
    assert times.observations() == [(7, {0: 0.1, 1: 0.2, 2: 0.3})]


def test_a_relay_summary_carries_its_ranks_compute_to_an_observation():
    core = RelayCore(K, messages.RankIdentity(JOB, 0, 0, 4, "h", 1), "n0")
    for rank in range(4):
        beat = msg("beat", rank, 9, phase="train", compute=0.01 * (rank + 1), wait=0.0)
        if rank == 0:
            core.own("beat", beat, 0.0)
        else:
            assert core.take(messages.encode(K, beat), 0.0) is None
    frame = core.summary_frame(0.0, 0.0)
    summary = messages.decode(K, frame, JOB)
    assert summary["compute"] == [0.01, 0.02, 0.03, 0.04]
    times = StepTimes(4)
    times.take(summary)
    assert times.observations() == [(9, {0: 0.01, 1: 0.02, 2: 0.03, 3: 0.04})]


def test_a_summary_of_the_most_ranks_with_compute_fits_a_message():
    """1,024 ranks stepping together, each compute distinct: it fits. Each at a step of its own
    too (the steps' runs are long then): the summary goes without its compute."""
    for spread in (0, 1):
        core = RelayCore(K, messages.RankIdentity(JOB, 0, 0, 1024, "h", 1), "n0")
        for rank in range(messages.MAX_RELAY_RANKS):
            beat = {"phase": "train", "step": 100 + spread * rank, "compute": 12 + rank / 977}
            core.fold(rank, "beat", beat, 0.0)
        summary = messages.decode(K, core.summary_frame(0.0, 0.0), JOB)
        if spread:
            assert "compute" not in summary
        else:
            assert len(summary["compute"]) == messages.MAX_RELAY_RANKS


@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        ({}, True),  # an old sender
        ({"compute": 0.1, "wait": 0}, True),
        ({"compute": -0.1}, False),
        ({"wait": float("nan")}, False),
        ({"compute": True}, False),
        ({"compute": "0.1"}, False),
        ({"wait": 1e12}, False),
    ],
)
def test_beat_and_step_timing_fields_are_validated(fields, ok):
    for message in (msg("beat", 0, 1, phase="train"), msg("step", 0, 1, loss=1.0, dt=0.1)):
        message.update(fields)
        assert_validates(message, ok)


@pytest.mark.parametrize(
    ("compute", "ok"),
    [([0.1, None], True), ([0.1], False), ([0.1, -1], False), ("0.1", False), ([0.1, "x"], False)],
)
def test_summary_compute_is_validated(compute, ok):
    ident = messages.RankIdentity(JOB, 0, 0, 4, "h", 1)
    message = ident.message(
        "summary", 0.0, node="n0", ranks=[[0, 2]], steps=[[3, 2]], phases="train", late=[]
    )
    message["compute"] = compute
    assert_validates(message, ok)


def assert_validates(message: dict, ok: bool) -> None:
    """`message` passes validation when `ok`, else is refused as a BadMessage."""
    if ok:
        messages.validate(message)
    else:
        with pytest.raises(messages.BadMessage):
            messages.validate(message)


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"threshold": 1.0}, "stragglers.threshold"),
        ({"window": 1}, "stragglers.window"),
        ({"action": "swap"}, "stragglers.action"),
    ],
)
def test_a_bad_stragglers_value_is_one_clear_error(table, key):
    with pytest.raises(ConfigError) as err:
        from_dict({"stragglers": table})
    assert err.value.key == key


def test_the_step_clock_splits_compute_from_wait():
    clock = StepClock()
    clock.start()
    with clock.waiting():
        time.sleep(0.03)
    time.sleep(0.02)
    compute, wait = clock.split()
    assert wait >= 0.03 and compute >= 0.02 and wait < 0.03 + 1.0
    clock.start()
    assert clock.wait == 0.0

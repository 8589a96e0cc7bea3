"""The numerical guard's pure decisions (worker.guard): judging a step, the baseline, the data
positions a bad step skips and the position each step trains on."""

from __future__ import annotations

import json
import math

import pytest

from worker import guard
from worker.args import guard_config, parse_args
from worker.errors import UsageError
from worker.guard import Baseline, GuardConfig, Verdict

CFG = GuardConfig(action="skip", factor=4.0, grad_factor=50.0, warmup=3, skip_batches=1)


def warmed(loss: float = 2.0, grad: float = 1.0, steps: int = 3) -> Baseline:
    base = Baseline()
    for _ in range(steps):
        base = base.updated(loss, grad, CFG.warmup)
    return base


def test_a_non_finite_value_is_bad_at_once_even_in_warmup():
    verdict = guard.judge(CFG, Baseline(), math.nan, 1.0, 1)
    assert (verdict.kind, verdict.what) == ("nan", "loss")
    assert guard.judge(CFG, Baseline(), 2.0, math.inf, 0) == Verdict("inf", math.inf, "grad_norm")
    # a rank's own non-finite gradient, the shared values finite: still bad
    assert guard.judge(CFG, Baseline(), 2.0, 1.0, 1) is not None


def test_spikes_are_judged_only_after_the_warmup():
    assert guard.judge(CFG, warmed(steps=2), 100.0, 1.0, 0) is None
    assert guard.judge(CFG, warmed(), 100.0, 1.0, 0) == Verdict("spike", 100.0, "loss")
    assert guard.judge(CFG, warmed(), 2.0, 51.0, 0) == Verdict("spike", 51.0, "grad_norm")


def test_a_falling_loss_is_never_a_spike():
    base = warmed(loss=5.0)
    for loss in (4.0, 1.0, 0.01, 0.0):
        assert guard.judge(CFG, base, loss, 0.5, 0) is None
    assert guard.judge(CFG, base, 19.9, 1.0, 0) is None  # under the factor
    assert guard.judge(CFG, base, 20.1, 1.0, 0) is not None


def test_the_baseline_is_a_plain_mean_then_exponential():
    base = Baseline().updated(1.0, 10.0, 2).updated(3.0, 20.0, 2)
    assert (base.good, base.loss, base.grad) == (2, 2.0, 15.0)
    assert base.updated(4.0, 15.0, 2).loss == 3.0  # weight 1/2 from the window on


def test_the_baseline_round_trips_through_a_json_record_exactly():
    base = warmed(loss=2.123456789, grad=0.3333333)
    again = Baseline.from_record(json.loads(json.dumps(base.record())))
    assert again == base
    assert Baseline.from_record(None) == Baseline()
    assert Baseline.from_record({"good": "x"}) == Baseline()


def test_blame_names_the_non_finite_ranks_and_their_value():
    verdict = Verdict("nan", math.nan, "grad_norm")
    named, ranks = guard.blame(verdict, CFG, warmed(), [2.0, 2.0, math.inf], [1.0, math.nan, 1.0])
    assert ranks == [1, 2]
    assert named.kind == "nan" and named.what == "grad_norm"
    named, ranks = guard.blame(verdict, CFG, warmed(), [math.inf, 2.0], [1.0, 1.0])
    assert (named.kind, named.value, named.what, ranks) == ("inf", math.inf, "loss", [0])


def test_blame_names_the_ranks_of_a_loss_spike_else_every_rank():
    spike = Verdict("spike", 60.0, "loss")
    assert guard.blame(spike, CFG, warmed(), [2.0, 118.0], [1.0, 1.0])[1] == [1]
    assert guard.blame(spike, CFG, warmed(), [7.0, 7.0], [1.0, 1.0])[1] == [0, 1]
    grad = Verdict("spike", 80.0, "grad_norm")
    assert guard.blame(grad, CFG, warmed(), [2.0, 2.0], [1.0, 1.0])[1] == [0, 1]


def test_positions_skip_the_ranges():
    assert [guard.position(s, ()) for s in (1, 2, 3)] == [1, 2, 3]
    ranges = guard.merge([(3, 4), (6, 6)])
    assert [guard.position(s, ranges) for s in range(1, 6)] == [1, 2, 5, 7, 8]
    assert guard.position(0, ((1, 2),)) == 0


def test_merge_sorts_and_joins_overlapping_and_adjacent_ranges():
    assert guard.merge([(8, 9), (1, 2), (3, 5), (4, 4), (12, 12)]) == ((1, 5), (8, 9), (12, 12))


def test_skip_takes_the_bad_steps_own_position():
    assert guard.skip_range(7, ()) == (7, 7)
    assert guard.skip_range(7, ((2, 3),)) == (9, 9)


def test_rollback_skips_from_the_checkpoint_through_the_bad_step_and_at_least_n():
    assert guard.rollback_range(4, 7, (), 1) == (5, 7)
    assert guard.rollback_range(4, 7, (), 5) == (5, 9)
    assert guard.rollback_range(6, 7, (), 1) == (7, 7)
    # positions already skipped before the checkpoint move the whole window
    assert guard.rollback_range(4, 7, ((2, 3),), 1) == (7, 9)


def test_a_run_given_the_ranges_sees_what_the_rolled_back_run_sees():
    """After a rollback to step 4 past bad step 7, step 5 trains where a run given the same
    range from the start trains its step 5."""
    skip = guard.rollback_range(4, 7, (), 5)
    after = guard.merge([skip])
    assert [guard.position(s, after) for s in (5, 6)] == [10, 11]
    assert guard.parse_ranges(guard.format_ranges(after)) == after


def test_parse_ranges():
    assert guard.parse_ranges("") == ()
    assert guard.parse_ranges("5-9, 20-20,7") == ((5, 9), (20, 20))
    for bad in ("0-3", "5-2", "a-b", "3-", "-4", "1-2-3"):
        with pytest.raises(ValueError):
            guard.parse_ranges(bad)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--guard", "maybe"], "argument --guard: invalid choice: 'maybe'"),
        (["--guard-factor", "1"], "--guard-factor must be a number above 1, got 1.0"),
        (["--guard-grad-factor", "nan"], "--guard-grad-factor must be a number above 1"),
        (["--guard-warmup", "0"], "--guard-warmup must be at least 1, got 0"),
        (
            ["--guard-skip-batches", "0"],
            "--guard-skip-batches must be 1 to 1,000,000,000 data positions, got 0",
        ),
        (["--skip-batches", "9-3"], "--skip-batches: '9-3': positions start at 1"),
    ],
)
def test_bad_guard_flags_are_one_clear_message(flags, said):
    with pytest.raises(UsageError) as caught:
        parse_args(flags)
    assert said in str(caught.value)


def test_guard_flags_reach_the_config():
    args = parse_args(["--guard", "rollback", "--guard-skip-batches", "5"])
    assert guard_config(args) == GuardConfig("rollback", 4.0, 10.0, 20, 5)
    assert parse_args([]).guard == "skip"

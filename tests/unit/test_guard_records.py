"""What a hostile user or a damaged checkpoint hands the numerical guard: flag values and data
records it must refuse with one clear reason (or start afresh from), never a traceback, never a
silent change of the data positions a run trains."""

from __future__ import annotations

import json
import math

import pytest

from worker import guard
from worker.errors import UsageError
from worker.guard import Baseline, GuardConfig
from worker.guard_step import GuardRun

CFG = GuardConfig("rollback", warmup=2)
GOOD = {"kind": "SyntheticData", "next_step": 13, "skip": "3-3,8-10"}
GOOD_BASE = {"good": 5, "loss": 2.5, "grad": 0.75}


@pytest.mark.parametrize("text", ["²", "١-٢", "1-²", "1-99999999999999999999", "٣"])
def test_ranges_take_ascii_digits_only_and_say_so(text):
    with pytest.raises(ValueError, match="expected ranges of data positions like 5-9"):
        guard.parse_ranges(text)


@pytest.mark.parametrize(
    "record",
    [
        {"good": math.inf, "loss": 1.0, "grad": 1.0},  # int(inf): OverflowError before
        {"good": -1, "loss": 1.0, "grad": 1.0},  # 1 / min(0, window): ZeroDivisionError before
        {"good": 3, "loss": math.nan, "grad": 1.0},  # a NaN baseline: no spike ever judged
        {"good": 3, "loss": 1.0, "grad": -2.0},
        {"good": True, "loss": 1.0, "grad": 1.0},
        {"good": "3", "loss": 1.0, "grad": 1.0},
        {"good": 3, "loss": "1", "grad": 1.0},
        {"good": 3, "loss": 1.0},
        [3, 1.0, 1.0],
        "x",
    ],
)
def test_a_damaged_baseline_is_named_and_never_used(record):
    assert guard.baseline_problem(record) is not None
    assert Baseline.from_record(record) == Baseline()
    assert guard.record_problem({**GOOD, "guard": record}) is not None
    # nothing the guard does with a fresh baseline divides by zero
    assert Baseline.from_record(record).updated(2.0, 1.0, 3) == Baseline(1, 2.0, 1.0)


@pytest.mark.parametrize(
    ("data", "said"),
    [
        ([1, 2], "the data record is a list"),
        ("3-3", "the data record is a str"),
        ({**GOOD, "skip": [[3, 3]]}, "skip: expected ranges"),
        ({**GOOD, "skip": 7}, "skip: expected ranges"),
        ({**GOOD, "skip": "5-3"}, "skip: '5-3'"),
        ({**GOOD, "skip": "a-b"}, "skip: expected ranges"),
        ({**GOOD, "skip": "1-1," * 300_000}, "skip: expected ranges"),  # over the size cap
    ],
)
def test_a_damaged_record_is_refused_with_its_reason(data, said):
    problem = guard.record_problem(json.loads(json.dumps(data)))
    assert problem is not None and said in problem
    with pytest.raises(UsageError, match="data record is damaged"):
        GuardRun.start(CFG, "", data, [], step=12)


def test_a_sound_record_and_an_older_checkpoints_are_taken():
    assert guard.record_problem(None) is None
    assert guard.record_problem({"kind": "SyntheticData", "next_step": 5}) is None
    data = json.loads(json.dumps({**GOOD, "guard": GOOD_BASE}))
    assert guard.record_problem(data) is None
    run = GuardRun.start(CFG, "", data, [], step=12)
    assert run.ranges == ((3, 3), (8, 10)) and run.baseline == Baseline(5, 2.5, 0.75)


def test_skip_batches_on_a_resume_may_not_rewrite_positions_already_trained():
    """Step 12 with 3-3,8-10 skipped trained positions up to 16: a flag range among them
    would make the record claim a skip that never happened and shift every later batch."""
    for flags in ("5-5", "16-20", "2-2,30-31"):
        with pytest.raises(UsageError, match="trained data positions up to 16"):
            GuardRun.start(CFG, flags, GOOD, [], step=12)
    # the record's own ranges again (a relaunch with the same flags), or only later positions
    assert GuardRun.start(CFG, "3-3,8-10,17-18", GOOD, [], step=12).ranges == (
        (3, 3),
        (8, 10),
        (17, 18),
    )
    assert GuardRun.start(CFG, "9-9", GOOD, [], step=12).ranges == ((3, 3), (8, 10))
    # a fresh start takes any ranges
    assert GuardRun.start(CFG, "1-2", None, [], step=0).ranges == ((1, 2),)


def test_the_guard_gives_up_after_ten_bad_steps_in_a_row_and_a_good_step_resets_the_count():
    """Weights blown up by --lr 1e30 made every step NaN: the skip looped for ever (seen: step
    2 redone on position after position until killed); now the run stops with one message."""
    run = GuardRun(GuardConfig("skip", warmup=1))
    for _ in range(guard.GIVE_UP_AFTER - 1):
        verdict = run.judge(math.nan, 1.0, 2)
        assert guard.give_up(run.bad_in_a_row, 2, verdict) is None
    assert run.judge(3.0, 1.0, 0) is None and run.bad_in_a_row == 0  # a good step in between
    for _ in range(guard.GIVE_UP_AFTER):
        verdict = run.judge(math.nan, 1.0, 2)
    said = guard.give_up(run.bad_in_a_row, 2, verdict)
    assert said.startswith("the numerical guard gave up: 10 bad steps in a row at step 2")
    assert "nan in loss" in said and "lower --lr" in said


def test_a_memory_slot_with_a_damaged_data_record_is_refused_like_a_torn_one():
    from pathlib import Path

    from worker.ckpt.manager import _data_problem
    from worker.ckpt.memory.held import Held

    held = Held(slot=1, step=7, gen=3, record={}, path=Path("slot-1.bin"))
    check = guard.record_problem  # what the loop hands the checkpoint package (worker.build)
    assert _data_problem(check, held, {"step": 7, "data": {**GOOD, "guard": GOOD_BASE}}) is None
    said = _data_problem(check, held, {"step": 7, "data": {**GOOD, "skip": "9-2"}})
    assert said.startswith("slot 1 (step 7): data skip: '9-2'")


def test_a_rollbacks_skip_is_bounded_so_its_record_stays_readable():
    """A 10^19-position skip wrote a 20-digit range no resume would read back."""
    from worker.args import parse_args

    with pytest.raises(UsageError, match="--guard-skip-batches must be 1 to 1,000,000,000"):
        parse_args(["--guard-skip-batches", str(10**19)])
    last = guard.rollback_range(10**12, 10**12 + 1, (), guard.MAX_SKIP_BATCHES)[1]
    assert guard.parse_ranges(f"1-{last}") == ((1, last),)


def test_a_spike_in_the_warmup_enters_the_baseline_only_at_the_spike_limit():
    """Whole, a 100x loss spike at step 4 of a 20-step warm-up lifted the baseline ~26x and
    hid 5x spikes until good step 79; clipped, they are caught from the warm-up's end."""
    cfg = GuardConfig("skip", warmup=20)
    run = GuardRun(cfg)
    for loss in (5.0, 5.0, 5.0, 500.0):
        assert run.judge(loss, 1.0, 0) is None  # the warm-up judges no spike
    assert run.baseline.loss == (5.0 + 5.0 + 5.0 + 20.0) / 4  # 500 entered as 4 x 5
    while run.baseline.good < cfg.warmup:
        assert run.judge(5.0, 1.0, 0) is None
    assert run.judge(25.0, 1.0, 0).kind == "spike"  # baseline 5.75: 25 is above 4 x
    whole = Baseline()
    for loss in (5.0, 5.0, 5.0, 500.0, *[5.0] * 16):
        whole = whole.updated(loss, 1.0, cfg.warmup)
    assert guard.judge(cfg, whole, 25.0, 1.0, 0) is None  # unclipped, baseline 29.75
    # a grad-norm spike alike, at grad_factor x
    run = GuardRun(cfg)
    run.judge(5.0, 1.0, 0)
    run.judge(5.0, 1000.0, 0)
    assert run.baseline.grad == (1.0 + cfg.grad_factor) / 2


def test_a_rollback_goes_only_to_a_checkpoint_of_this_runs_own_past():
    """With --no-resume, a NaN at step 2 rolled back to the previous run's step 6 in the same
    directory and the run went on from there; now only its own, older checkpoints count."""
    from worker.ckpt.resume import may_roll_back_to

    assert not may_roll_back_to(6, 2, set())  # another run's, and ahead of the bad step
    assert not may_roll_back_to(4, 5, {3})  # another run's, though older
    assert not may_roll_back_to(5, 5, {5})  # never the bad step's own or a later one
    assert not may_roll_back_to(None, 5, {3})
    assert may_roll_back_to(3, 5, {3, 5})

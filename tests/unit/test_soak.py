"""bench/soak.py's pure parts: the seeded failure trace, its `[[faults]]` tables, and the
arithmetic of progress, goodput, per-failure cost and the bit-exact check. No process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import soak_figures as fig  # noqa: E402
import soak_trace as tr  # noqa: E402

MIXED_SHAPE = tr.Shape(nodes=3, ranks_per_node=1, spares=1)
KILL_SHAPE = tr.Shape(nodes=1, ranks_per_node=2)


def test_times_are_seeded_jittered_and_inside_the_window():
    got = tr.times(15, 150, seed=0)
    assert got == tr.times(15, 150, seed=0)
    assert got != tr.times(15, 150, seed=1)
    gaps = [b - a for a, b in zip([0.0, *got], got, strict=False)]
    assert all(15 * 0.7 <= g <= 15 * 1.3 + 1e-6 for g in gaps)
    assert got[-1] < 150 and len(got) >= 150 / (15 * 1.3) - 1


def test_kills_and_mixed_of_one_seed_fail_at_the_same_times():
    kills = tr.make_trace(tr.KILLS, rate_s=15, duration_s=150, seed=4, shape=KILL_SHAPE)
    mixed = tr.make_trace(tr.MIXED, rate_s=15, duration_s=150, seed=4, shape=MIXED_SHAPE)
    assert [f.at_s for f in kills] == [f.at_s for f in mixed]
    assert {(f.kind, f.target) for f in kills} == {("kill", None)}


@pytest.mark.parametrize("seed", range(20))
def test_a_mixed_trace_never_excludes_a_node_nor_loses_more_than_the_spares(seed):
    trace = tr.make_trace(tr.MIXED, rate_s=8, duration_s=300, seed=seed, shape=MIXED_SHAPE)
    assert trace == tr.make_trace(tr.MIXED, rate_s=8, duration_s=300, seed=seed,
                                  shape=MIXED_SHAPE)  # fmt: skip
    assert sum(f.kind == "node_loss" for f in trace) <= MIXED_SHAPE.spares
    laid = [0] * MIXED_SHAPE.nodes  # by active position; a lost node's place starts afresh
    for f in trace:
        if f.kind == "node_loss":
            laid[f.target] = 0
        elif f.kind in tr.LAID:
            laid[f.target] += 1
            assert laid[f.target] < MIXED_SHAPE.exclude_after, trace
        if f.kind != "kill":
            assert 0 <= f.target < MIXED_SHAPE.world
    assert {f.kind for f in trace} <= set(tr.MIXED)


def test_one_node_gets_no_node_loss_and_its_failures_are_never_laid():
    trace = tr.make_trace(tr.MIXED, rate_s=5, duration_s=200, seed=2, shape=KILL_SHAPE)
    assert "node_loss" not in {f.kind for f in trace}
    assert sum(f.kind in tr.LAID for f in trace) > 2  # one node is never excluded


def test_project_faults_put_each_failure_at_the_start_up_plus_its_time():
    trace = [tr.Fault(0, 12.5, "kill", None), tr.Fault(1, 40.0, "node_loss", 2),
             tr.Fault(2, 70.0, "slow", 1), tr.Fault(3, 90.0, "kill_rank", 0)]  # fmt: skip
    got = tr.project_faults(trace, startup_s=9.25)
    assert got[0] == {"name": "soak-0-kill", "at_s": [21.75], "action": "kill", "target": "all"}
    assert (got[1]["action"], got[1]["target"]) == ("node_loss", "node:2")
    assert got[2]["delay_s"] == tr.SLOW_DELAY_S and got[2]["target"] == "rank:1"
    assert (got[3]["action"], got[3]["target"]) == ("kill", "rank:0")
    assert set(tr.TORCHRUN_GIVEN) == set(tr.MIXED)


def rec(step, t, attempt=0, loss=1.0):
    return {"step": step, "t": t, "attempt": attempt, "loss": loss}


def test_progress_is_the_highest_step_done_in_the_window():
    records = [rec(1, 100.0), rec(2, 101.0), rec(3, 102.0), rec(2, 106.0, 1), rec(3, 107.0, 1),
               rec(4, 108.0, 1)]  # fmt: skip
    assert fig.progress(records, t0=100.0, duration_s=7.5) == 3  # step 3 again, no further
    assert fig.progress(records, t0=100.0, duration_s=8.0) == 4
    assert fig.best_at(records, 99.0) == 0
    assert fig.goodput(300, 400) == 0.75
    assert fig.goodput(0, 400) == 0.0 and fig.goodput(300, None) is None
    assert fig.pace(500, 150.0) == pytest.approx(0.3)


def test_interval_costs_add_up_to_the_deficit():
    # 1 s a step clean; a failure at 10 costs 4 s (step 11 comes at 15), one at 20 nothing.
    records = [rec(s, float(s)) for s in range(1, 11)]
    records += [rec(s, float(s + 4)) for s in range(11, 30)]
    costs = fig.interval_costs(records, [10.0, 20.0], end=30.0, pace_s=1.0)
    assert costs == pytest.approx([4.0, 0.0])
    assert sum(costs) == pytest.approx((30.0 - 10.0) - (26 - 10) * 1.0)


def test_the_work_redone_is_the_step_in_flight_and_the_steps_lost():
    # 1 s a step; killed 0.4 s into step 11 (lost 2: resumed from 8), then 0.9 s into step 21
    # (lost 0); a failure before any step throws no step in flight away.
    records = [rec(s, float(s)) for s in range(1, 11)] + [rec(s, s + 3.0) for s in range(9, 18)]
    records += [rec(s, s + 5.0) for s in range(18, 25)]
    got = fig.redone(records, [(10.4, 2), (20.9, 0), (0.5, 0)], pace_s=1.0)
    assert got == pytest.approx({"in_flight_s": 1.3, "lost_s": 2.0})
    assert fig.ceiling_over(got, duration_s=100.0) == pytest.approx(0.967)


def test_a_nan_s_skip_stays_unless_a_later_resume_goes_back_before_it():
    found = fig.numerics(bad=[(0, 20), (2, 50)], resumes=[(1, 30), (2, 40), (3, 45)])
    assert [(n.step, n.stayed) for n in found] == [(20, True), (50, False)]
    assert fig.skip_positions(found) == [20]
    two = fig.numerics(bad=[(0, 20), (0, 25)], resumes=[])
    assert fig.skip_positions(two) == [20, 26]  # the second skip's step trains on position 26


def test_each_record_is_held_to_the_reference_of_the_skips_it_trained_with():
    # Attempt 0 reached step 6 without a skip; attempt 3 resumed from 1 and skipped at 6;
    # attempt 4 resumed from its checkpoint of 10, the skip with it.
    resumes = [(3, 1), (4, 10)]
    found = fig.numerics(bad=[(3, 6)], resumes=resumes)
    clean = {s: float(s) for s in range(1, 30)}
    skipped = {s: float(s) + (0.5 if s >= 6 else 0.0) for s in range(1, 20)}
    records = [rec(s, s, 0, clean[s]) for s in range(1, 7)]
    records += [rec(s, 10 + s, 3, skipped[s]) for s in range(2, 11)]
    records += [rec(s, 20 + s, 4, skipped[s]) for s in range(11, 13)] + [rec(13, 40, 4, 0.0)]
    assert fig.reference_for(records[5], found, resumes) == "clean"  # attempt 0's step 6
    assert fig.reference_for(records[-1], found, resumes) == "skipped"
    got = fig.exactness(records, {"clean": clean, "skipped": skipped}, found, resumes)
    assert (got.wrong, got.checked, got.not_checked) == ([13], 13, 0)
    # Without the clean run, steps before the first skip are held to the skipped run's.
    alone = fig.exactness(records, {"skipped": skipped}, found, resumes)
    assert (alone.wrong, alone.checked) == ([13], 13)
    assert fig.exactness(records, {"clean": clean}, found, resumes).checked == 6


def test_a_record_that_trained_with_an_undone_skip_is_not_checked():
    resumes = [(1, 30), (2, 40), (3, 45)]
    found = fig.numerics(bad=[(2, 50)], resumes=resumes)
    clean = {s: float(s) for s in range(1, 60)}
    records = [rec(s, s, 2, 999.0 if s >= 50 else float(s)) for s in range(41, 53)]
    records += [rec(s, 100 + s, 3, float(s)) for s in range(46, 56)] + [rec(70, 200, 3, 70.0)]
    assert fig.reference_for(records[10], found, resumes) is None  # attempt 2's step 51
    got = fig.exactness(records, {"clean": clean}, found, resumes)
    assert (got.wrong, got.checked, got.not_checked) == ([], 15, 1)  # step 70: past the clean


def test_after_failures_reads_each_restart_from_the_records_alone():
    start = {"train/startup_seconds": 5.0}
    records = [rec(s, float(s)) for s in range(1, 9)]
    records += [{**rec(1, 20.0, 1), **start}, rec(2, 21.0, 1)]  # fresh: nothing was saved
    records += [{**rec(7, 30.0, 2), **start}, rec(8, 31.0, 2)]  # resumed from step 6
    got = fig.after_failures(records, [8.5, 21.5, 40.0])
    assert got[0] == {"downtime_s": 11.5, "resumed": 0, "lost": 8}
    assert got[1] == {"downtime_s": 8.5, "resumed": 6, "lost": 0}  # newest before: step 2
    assert got[2] == {}  # no start after it


def test_the_windows_each_goal_compares_closely_run_side_by_side():
    got = fig.window_order(["project", "torchrun"], 3, clean=True, timed="project")
    assert got == [
        (0, "torchrun", True), (0, "torchrun", False), (0, "project", False),
        (0, "project", True),
        (1, "project", True), (1, "project", False), (1, "torchrun", False),
        (1, "torchrun", True),
        (2, "torchrun", True), (2, "torchrun", False), (2, "project", False),
        (2, "project", True),
    ]  # fmt: skip
    for i in range(3):
        at = {(s, traced): got.index((i, s, traced)) for _, s, traced in got if _ == i}
        # Goodput (each system's traced over its clean) and the clean ratio: side by side.
        for system in ("project", "torchrun"):
            assert abs(at[system, True] - at[system, False]) == 1
        assert abs(at["project", False] - at["torchrun", False]) == 1
    # The project's first traced window comes after a clean one of its own (its start-up),
    # whatever the systems' order, and when it runs alone.
    assert fig.window_order(["torchrun", "project"], 3, True, timed="project") == got
    assert fig.window_order(["project"], 2, True, timed="project") == [
        (0, "project", False), (0, "project", True), (1, "project", True),
        (1, "project", False),
    ]  # fmt: skip
    assert fig.window_order(["torchrun"], 2, clean=False) == [(0, "torchrun", True),
                                                              (1, "torchrun", True)]  # fmt: skip


def test_the_ratio_is_the_median_of_each_run_s_pair():
    runs = fig.run_ratios([90, 200, 100], [100, 100, 100])
    assert runs == [0.9, 2.0, 1.0]
    assert fig.median(runs) == 1.0
    # A slow spell in the third pair weighs on both of its sides; the ratio of the medians
    # (100 / 100) would not see that the project made fewer steps in two pairs of three.
    assert fig.median(fig.run_ratios([90, 100, 110], [100, 110, 90])) == 100 / 110
    # No figure on either side, or none to divide by: no ratio; a project that made no step: 0.
    assert fig.run_ratios([None, 5, 0, 7], [3, None, 4, 0]) == [None, None, 0.0, None]

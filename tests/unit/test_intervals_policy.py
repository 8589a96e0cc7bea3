"""The self-tuning checkpoint interval (supervisor.policy.intervals, contracts.intervals): the
formula, the failure estimate, the hysteresis, and a synthetic run whose failure rate changes
10x halfway, where the tuned schedule must waste no more than 10 % over the best fixed interval
for that very run (found by trying the fixed ones). No processes.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence

import pytest

from contracts import intervals
from supervisor.policy import intervals as policy
from supervisor.policy.intervals import IntervalInputs


def test_daly_is_young_corrected_and_the_mtbf_when_a_save_costs_as_much():
    young = math.sqrt(2 * 10 * 3600)
    assert young - 10 < intervals.daly_seconds(10, 3600) < young
    assert intervals.daly_seconds(10, 3600) == pytest.approx(
        young * (1 + math.sqrt(10 / 7200) / 3 + 10 / 7200 / 9) - 10
    )
    assert intervals.daly_seconds(50, 20) == 20  # C >= 2M: M itself
    assert intervals.daly_seconds(0, 3600) == 0


def test_steps_are_whole_and_clamped():
    assert intervals.interval_steps(0.01, 0.05, 3600, 10**6) == round(
        intervals.daly_seconds(0.01, 3600) / 0.05
    )
    assert intervals.interval_steps(0.0, 0.05, 3600, 100) == 1  # free copies: every step
    assert intervals.interval_steps(10, 0.001, 1e9, 500) == 500  # the run's end caps it
    assert intervals.interval_steps(1, 0.1, math.inf, 300) == 300  # no failure in sight
    assert intervals.interval_steps(1, 0.0, 3600, 300) == 1  # no step time to go by


def test_a_dead_band_around_the_interval_in_force():
    """Retuned only when the exact optimum moves a fifth or more from the interval in force:
    measures that wander about a rounding point leave it be."""
    step_s, mtbf = 1.0, 1000.0

    def cost_for(exact: float) -> float:  # the cost whose optimum is `exact` steps
        lo, hi = 0.0, 1000.0
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if intervals.daly_seconds(mid, mtbf) < exact else (lo, mid)
        return lo

    def retune(old: int | None, exact: float) -> int | None:
        return intervals.retune(old, cost_for(exact), step_s, mtbf, 10_000, 0.2)

    assert retune(None, 7.2) == 7
    for exact in (30.4, 32.0, 35.9, 24.1):
        assert retune(30, exact) is None, exact  # within a fifth
    assert retune(30, 36.6) == 37 and retune(30, 23.4) == 23
    assert retune(36, 30.4) is None  # no flip back
    for exact in (1.3, 1.6, 1.4, 1.74):  # a short interval: at least 0.75 step away
        assert retune(1, exact) is None and retune(2, exact) is None, exact
    assert retune(1, 1.8) == 2 and retune(2, 1.2) == 1
    assert intervals.retune(100, cost_for(500), step_s, mtbf, 100, 0.2) is None  # capped


def test_the_prior_stands_until_the_first_failure():
    prior = 1000.0
    assert policy.mtbf_estimate([], 0.0, prior) == prior
    assert policy.mtbf_estimate([], 600.0, prior) == prior + 600  # quiet time counts
    assert policy.mtbf_estimate([50.0], 100.0, prior) == 100.0  # the prior is gone
    assert policy.mtbf_estimate([50.0, 90.0], 100.0, prior) == 50.0


def test_the_estimate_follows_a_change_of_rate_both_ways():
    dense = [10.0 * i for i in range(1, 21)]  # every 10 s up to 200 s
    assert policy.mtbf_estimate(dense, 200.0, 1e6) == pytest.approx(10.0)
    # quiet since: the estimate rises before the next failure comes
    assert policy.mtbf_estimate(dense, 300.0, 1e6) == pytest.approx((300 - 150) / 5)
    sparse_then = dense + [200.0 + 100 * i for i in range(1, 6)]
    assert policy.mtbf_estimate(sparse_then, 700.0, 1e6) == pytest.approx(100.0)
    back = sparse_then + [700.0 + 10 * i for i in range(1, 6)]  # dense again
    assert policy.mtbf_estimate(back, 750.0, 1e6) == pytest.approx(10.0)


def test_decide_sends_only_a_move_worth_sending():
    inputs = IntervalInputs(0.02, 0.05, [], 0.0, 3600.0, 10**6)
    first = policy.decide(inputs, None)
    assert first.send and first.mtbf_s == 3600
    assert first.steps == intervals.interval_steps(0.02, 0.05, 3600, 10**6)
    again = policy.decide(inputs, first.steps)
    assert not again.send and again.steps == first.steps
    assert not policy.decide(inputs, round(first.steps * 1.1)).send
    moved = policy.decide(inputs, first.steps * 2)
    assert moved.send and moved.steps == first.steps


# --- a synthetic run --------------------------------------------------------------------------
def simulate(
    failures: Sequence[float],
    work: int,
    step_s: float,
    cost_s: float,
    restart_s: float,
    choose: Callable[[float, list[float], int | None], int],
) -> float:
    """Seconds wasted reaching step `work` under failures at the given times: every save's
    cost, and the work a failure throws away (the steps since the last save, the save or step
    it hit). A save lands `every` steps after the last one, as in the worker; `choose(now,
    failures seen, interval in force)` gives the interval after each save and each failure,
    as the supervisor decides it as costs and failures reach it."""
    t, done, saved, waste = 0.0, 0, 0, 0.0
    seen: list[float] = []
    every = choose(t, seen, None)
    while done < work:
        stop = min(work, done + every)  # `every` steps after the last save (worker.intervals)
        saving = stop < work
        end = t + (stop - done) * step_s + (cost_s if saving else 0.0)
        i = bisect.bisect_right(failures, t)
        if i < len(failures) and failures[i] < end:  # a failure before the segment is through
            hit = failures[i]
            waste += hit - t + (done - saved) * step_s
            seen.append(hit)
            t, done = hit + restart_s, saved
            every = choose(t, seen, every)
            continue
        t, done = end, stop
        if saving:
            waste += cost_s
            saved = done
            every = choose(t, seen, every)
    return waste


def poisson(seed: int, phases: Sequence[tuple[float, float, float]]) -> list[float]:
    """Failure times: (start, end, mtbf) phases of a piecewise-constant rate."""
    rng, out = random.Random(seed), []
    for start, end, mtbf in phases:
        t = start
        while (t := t + rng.expovariate(1 / mtbf)) < end:
            out.append(t)
    return out


STEP_S, COST_S, RESTART_S, WORK = 1.0, 10.0, 20.0, 40_000
FIXED = sorted({round(10 * 1.05**i) for i in range(100)})  # 10 to ~1,250 steps


def best_fixed(failures: list[float]) -> float:
    return min(
        simulate(failures, WORK, STEP_S, COST_S, RESTART_S, lambda t, f, e, n=n: n) for n in FIXED
    )


def auto(prior_s: float) -> Callable[[float, list[float], int | None], int]:
    def choose(now: float, seen: list[float], every: int | None) -> int:
        inputs = IntervalInputs(COST_S, STEP_S, seen, now, prior_s, WORK)
        decision = policy.decide(inputs, every)
        return decision.steps if decision.send or every is None else every

    return choose


@pytest.mark.parametrize(
    ("first", "second", "prior_s"),
    [(300.0, 3000.0, 3000.0), (3000.0, 300.0, 3000.0), (300.0, 3000.0, 30000.0)],
    ids=["dense-then-sparse", "sparse-then-dense", "dense-then-sparse-prior-10x-off"],
)
def test_a_rate_changed_10x_halfway_costs_at_most_10_percent_over_the_best_fixed(
    first: float, second: float, prior_s: float
):
    """Eight seeded runs each: the tuned schedule's waste (saves + work redone) over the best
    fixed interval for that same run, found by trying every fixed one. On average at most
    1.10; no run above 1.25. (The best fixed interval is chosen knowing the run's failures, so
    in one run it may be lucky in where its saves fall: with some 8 failures in the sparse half,
    30 seeds of each case averaged 0.98-0.99 and single runs reached 1.09.)"""
    half = WORK * STEP_S * 1.15 / 2  # about halfway through the run (waste and restarts ~15 %)
    ratios = []
    for seed in range(8):
        failures = poisson(seed, [(0.0, half, first), (half, 10 * WORK, second)])
        tuned = simulate(failures, WORK, STEP_S, COST_S, RESTART_S, auto(prior_s))
        ratios.append(tuned / best_fixed(failures))
    assert sum(ratios) / len(ratios) <= 1.10 and max(ratios) <= 1.25, ratios


def test_the_tuned_interval_moves_with_the_rate():
    """Dense failures shorten the interval, a quiet spell lengthens it again."""
    seen: list[float] = []
    chosen = []
    choose = auto(3000.0)
    every = choose(0.0, seen, None)
    chosen.append(every)
    for t in range(100, 2100, 100):  # a failure every 100 s
        seen.append(float(t))
        every = choose(t + 1.0, seen, every)
    chosen.append(every)
    every = choose(2000.0 + 5000.0, seen, every)  # nothing for 5,000 s
    chosen.append(every)
    assert chosen[1] < chosen[0] / 2 and chosen[2] > chosen[1] * 2, chosen

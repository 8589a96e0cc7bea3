"""The arithmetic of `bench/soak.py`, pure: progress in a window, goodput, what each failure
cost, and which steps' losses differ from a reference. Records are rank 0's metrics lines (dicts
with `step`, wall time `t` and `loss`), each with the `attempt` it came from added.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def best_at(records: Iterable[dict], t: float) -> int:
    """The highest step done by wall time `t` (0: none yet)."""
    return max((r["step"] for r in records if r["t"] <= t), default=0)


def progress(records: Sequence[dict], t0: float, duration_s: float) -> int:
    """Steps done in the window: the highest step rank 0 recorded by `t0 + duration_s`. A step
    a failure in the window's last moments lost, not yet done again, still counts."""
    return best_at(records, t0 + duration_s)


def goodput(trace_steps: int | None, clean_steps: int | None) -> float | None:
    """Progress under failures over the same system's clean progress."""
    if not trace_steps or not clean_steps:
        return None if clean_steps is None or trace_steps is None else 0.0
    return trace_steps / clean_steps


def interval_costs(
    records: Sequence[dict], fired: Sequence[float], end: float, pace_s: float
) -> list[float]:
    """What each failure cost, in seconds of clean progress: from its firing to the next one
    (the last: to `end`), the time that passed less the clean time of the steps gained.
    `fired` is sorted wall times; `pace_s` the clean run's seconds per step. The costs add up
    to the whole deficit from the first failure on, each kind's aftermath (detection, restart,
    steps redone, a standby's preparation beside the next attempt) in its own row."""
    out = []
    for i, t in enumerate(fired):
        nxt = fired[i + 1] if i + 1 < len(fired) else end
        gained = best_at(records, nxt) - best_at(records, t)
        out.append((nxt - t) - gained * pace_s)
    return out


def redone(records: Sequence[dict], lost: Sequence[tuple[float, int]], pace_s: float) -> dict:
    """The work the failures threw away, which a relaunch however quick must do again: per
    failure that ended an attempt (`lost`: its wall time and the steps it lost), the step in
    flight (from the newest step done before it to the failure) and the steps done since the
    checkpoint resumed from (at `pace_s` each), in seconds. The goodput of a window whose only
    loss that was, its ceiling, is `ceiling_over`."""
    flight = sum(t - max((r["t"] for r in records if r["t"] <= t), default=t) for t, _ in lost)
    steps = sum(n for _, n in lost) * pace_s
    return {"in_flight_s": flight, "lost_s": steps}


def ceiling_over(redone_s: dict, duration_s: float) -> float:
    """Goodput with nothing lost but `redone` (`redone`'s dict): 1 - its seconds / the window."""
    return 1.0 - (redone_s["in_flight_s"] + redone_s["lost_s"]) / duration_s


def after_failures(records: Sequence[dict], fired: Sequence[float]) -> list[dict]:
    """Per failure that ended an attempt (`fired`: sorted wall times), from rank 0's records of
    a launcher that says nothing else: the next start's first step (the first record after it
    carrying `train/startup_seconds`, before the next failure), the downtime to it, the step it
    resumed from (0: fresh) and the steps lost (the newest step done before the failure less
    that). Empty for a failure no start followed."""
    out = []
    for i, t in enumerate(fired):
        nxt = fired[i + 1] if i + 1 < len(fired) else float("inf")
        first = next((r for r in records if t < r["t"] < nxt and "train/startup_seconds" in r),
                     None)  # fmt: skip
        before = [r for r in records if r["t"] < t]
        if first is None or not before:
            out.append({})
            continue
        resumed = first["step"] - 1
        done = max(before, key=lambda r: r["t"])["step"]
        out.append({"downtime_s": first["t"] - t, "resumed": resumed,
                    "lost": max(0, done - resumed)})  # fmt: skip
    return out


def pace(clean_steps: int | None, duration_s: float) -> float | None:
    """The clean run's seconds per step over its window."""
    return duration_s / clean_steps if clean_steps else None


@dataclass(frozen=True)
class Numeric:
    """A bad step the guard skipped: its step, the attempt, and whether its skip stayed (the
    last attempt's line of checkpoints holds it)."""

    step: int
    attempt: int
    stayed: bool


def inherits(step: int, attempt: int, later: int, resumes: Sequence[tuple[int, int]]) -> bool:
    """Whether attempt `later` trains with a skip made at `step` by `attempt`: it is that
    attempt or a later one, and no attempt between resumed from before the step (a resume from
    a checkpoint past it carries the skip in its data record; an earlier checkpoint's line has
    none)."""
    if later < attempt:
        return False
    return not any(attempt < b <= later and r < step for b, r in resumes)


def numerics(bad: Sequence[tuple[int, int]], resumes: Sequence[tuple[int, int]]) -> list[Numeric]:
    """`bad`: (attempt, step) of each skipped step; `resumes`: (attempt, resumed step) of each
    relaunched attempt. A skip stays unless a later attempt resumed from before it."""
    last = max([a for a, _ in bad] + [b for b, _ in resumes], default=0)
    return [Numeric(step, a, inherits(step, a, last, resumes)) for a, step in bad]


def skip_positions(found: Sequence[Numeric]) -> list[int]:
    """The data positions the stayed skips dropped: step s trains on the s-th position not
    skipped, so the k-th stayed skip (in step order) at step s dropped position s + k."""
    stayed = sorted(n.step for n in found if n.stayed)
    return [s + k for k, s in enumerate(stayed)]


def reference_for(
    record: dict, found: Sequence[Numeric], resumes: Sequence[tuple[int, int]]
) -> str | None:
    """Which reference a record must equal: `clean` (no skip reached it), `skipped` (the worker
    run with every stayed skip: the record trained with those of them up to its step, and no
    other), else None (it trained with a skip a later resume undid: no reference has it)."""
    s, a = record["step"], record["attempt"]
    applied = {n for n in found if n.step <= s and inherits(n.step, n.attempt, a, resumes)}
    if not applied:
        return "clean"
    if applied == {n for n in found if n.stayed and n.step <= s}:
        return "skipped"
    return None


@dataclass
class Exactness:
    """Steps whose loss differs from the reference's (any record of the step), and how many
    steps were compared."""

    wrong: list[int]
    checked: int
    not_checked: int  # past the reference's last step, or trained with a skip undone later

    def as_dict(self) -> dict:
        return {"wrong": len(self.wrong), "checked": self.checked,
                "not_checked": self.not_checked, "first_wrong": self.wrong[:5]}  # fmt: skip


def exactness(
    records: Sequence[dict],
    references: dict[str, dict[int, object]],
    found: Sequence[Numeric] = (),
    resumes: Sequence[tuple[int, int]] = (),
) -> Exactness:
    """Every record's loss against its reference's loss at its step, bit for bit.
    `references`: step -> loss of `clean` (the clean run) and, after a stayed skip, `skipped`;
    a record with no skip reached is checked against `skipped` when there is no clean run
    (the two agree up to the first skip)."""
    wrong, checked, skipped = set(), set(), set()
    for r in records:
        which = reference_for(r, found, resumes)
        ref = references.get(which) if which else None
        if (
            which == "clean"
            and ref is None
            and not any(n.stayed and n.step <= r["step"] for n in found)
        ):
            ref = references.get("skipped")
        if ref is None or r["step"] not in ref:
            skipped.add(r["step"])
            continue
        checked.add(r["step"])
        if r["loss"] != ref[r["step"]]:
            wrong.add(r["step"])
    return Exactness(sorted(wrong), len(checked), len(skipped - checked))


def median(values: Iterable[float | int | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def window_order(
    systems: Sequence[str], runs: int, clean: bool, timed: str | None = None
) -> list[tuple[int, str, bool]]:
    """The windows, in the order they run: (run, system, traced). The host's speed drifts over
    minutes, so the windows compared against the goals that leave little margin come side by
    side: each run is A's traced window, A's clean, B's clean, B's traced (a system's goodput
    is its traced window over its clean one; the clean ratio is clean over clean). The two
    traced windows, compared for the ratio under the trace, are the furthest apart. The next
    run swaps A and B, so that neither system always goes first. `timed` is the system whose
    faults are timed from a start-up its clean window measured (the project): the first run
    begins with the other, and where there is none, with its clean window."""
    base = sorted(systems, key=lambda s: s == timed)  # stable: `timed` last
    out: list[tuple[int, str, bool]] = []
    for i in range(runs):
        first, *rest = base if i % 2 == 0 else base[::-1]
        lead = [(i, first, True)] + ([(i, first, False)] if clean else [])
        if i == 0 and first == timed:
            lead.reverse()
        out += lead + [(i, s, False) for s in rest if clean] + [(i, s, True) for s in rest]
    return out


def run_ratios(mine: Sequence[int | None], theirs: Sequence[int | None]) -> list[float | None]:
    """Each run's ratio: run i's figure over the other system's figure of run i (None where
    either has none, or the other's is 0). A slow spell of the host then weighs on both sides
    of a ratio rather than on one system's median (`window_order` puts the clean windows side
    by side); the summary takes the median of these."""
    return [a / b if a is not None and b else None for a, b in zip(mine, theirs, strict=True)]

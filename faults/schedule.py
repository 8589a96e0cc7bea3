"""Which faults fire now: a pure function of what the supervisor has observed.

`Schedule.due(facts)` is called on every tick and on every message that may matter; it returns
the firings and remembers which trigger points are spent, so each point fires once. It does no
I/O and reads no clock: the same schedule, seed and facts give the same firings (unit-tested
with plain values). `faults.engine` gathers the facts and carries the firings out.

Rules:
- A fault fires only into a running attempt whose target ranks have all said hello and are
  alive, before any rank said done; a time trigger also waits until they train (phase `train`
  or `save`, and the attempt's first step done), so that every attempt it hits got past its
  restart and its failure costs measurable steps. A point that comes due
  otherwise waits (its delay is recorded). After a disruptive fault (anything but `slow`) the
  attempt is over: the rest wait for the next one, so two faults never pile onto one dying
  attempt.
- Time: `at_s` points are seconds since the job started; `every_s` (+ jitter) and `mtbf_s`
  (exponential) count from the previous firing of the same fault, like the study's
  `while sleep 90; do pkill -9; done` loop.
- Steps: a point N fires at the first observed step >= N; with `after_checkpoint` only once a
  checkpoint at or past N is known complete. Points are never re-fired after a resume.
- `nan` and `spike` act at their very step, so their command goes ahead of it: a step point N
  is sent once the newest step seen is N - AHEAD_STEPS (before an attempt's first step: the
  newest of any attempt, where a resume starts at or before), and the rank holds it for step
  N; every such point in reach goes at once. A time trigger's names the step AHEAD_STEPS past
  the newest seen. A point whose attempt ended before its step is given back (`give_back`) and
  goes to the next attempt.
- `during = "save"`: while a save is in flight (phase `save`, or staged/written but not yet
  complete), once per save step; with `at_step`, the first save at or after each step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from faults.spec import DISRUPTIVE, NUMERIC, FaultSpec, Trigger

# How many steps ahead a `nan` or `spike` goes: rank 0's word of step N - AHEAD_STEPS fires
# point N, and the command then has the rank's next AHEAD_STEPS - 1 steps to arrive in.
AHEAD_STEPS = 4


@dataclass(frozen=True)
class Facts:
    """The supervisor's view at one instant (times in seconds since the job started)."""

    elapsed_s: float
    world: int
    ranks_per_node: int = 1
    attempt: int | None = None  # None: no attempt running
    step: int | None = None  # highest step reported in this attempt
    saving: int | None = None  # the step of a save in flight
    ckpt_complete: int | None = None  # newest checkpoint known complete (and not damaged)
    ready: frozenset[int] = frozenset()  # ranks said hello, alive
    training: frozenset[int] = frozenset()  # ... and in phase train or save
    disrupted: bool = False  # a disruptive fault already hit this attempt
    finishing: bool = False  # a rank said done


@dataclass(frozen=True)
class Firing:
    """One fault to inject now."""

    spec: FaultSpec
    n: int  # this fault's n-th firing (1-based)
    # The trigger point: {"due_s": 10.0} (time), {"step": 500}, {"save": 20} or both.
    point: dict[str, float | int]
    ranks: tuple[int, ...]
    due_s: float | None = None  # time triggers: when it was due (seconds since the job started)
    at_step: int | None = None  # nan / spike: the step the rank acts at


@dataclass
class _State:
    fired: int = 0
    last_fire_s: float = 0.0
    spent_steps: set[int] = field(default_factory=set)
    spent_saves: set[int] = field(default_factory=set)
    next_index: int = 0  # at_s: the next point; every_steps: multiples already spent


class Schedule:
    def __init__(self, specs: Sequence[FaultSpec]) -> None:
        self.specs = list(specs)
        self._state = [_State() for _ in self.specs]
        self.high = 0  # the newest step seen in any attempt (a resume starts at or before it)

    def fired(self) -> dict[str, int]:
        """Firings so far, by fault label."""
        return {s.label: st.fired for s, st in zip(self.specs, self._state, strict=True)}

    def due(self, facts: Facts) -> list[Firing]:
        """The faults that fire now; their points are spent."""
        out: list[Firing] = []
        if facts.attempt is None or facts.finishing or facts.disrupted:
            return out
        self.high = max(self.high, facts.step or 0)
        disrupted = False
        for spec, st in zip(self.specs, self._state, strict=True):
            if disrupted:
                break
            if spec.action.kind in ("corrupt", "unmark") and facts.ckpt_complete is None:
                continue  # nothing to damage yet
            ranks = targets(spec, st.fired + 1, facts.world, facts.ranks_per_node)
            if spec.trigger.timed and (facts.step is None or not set(ranks) <= facts.training):
                continue
            if not set(ranks) <= facts.ready:
                continue
            ahead = AHEAD_STEPS if spec.action.kind in NUMERIC else 0
            while (reached := _point(spec.trigger, st, facts, ahead, self.high)) is not None:
                point, due_s = reached
                _spend(spec.trigger, st, point, facts)
                st.fired += 1
                st.last_fire_s = facts.elapsed_s
                at = int(point["step"]) if "step" in point else (facts.step or 0) + ahead
                out.append(Firing(spec, st.fired, point, ranks, due_s, at if ahead else None))
                disrupted = spec.action.kind in DISRUPTIVE
                if not ahead or "step" not in point:  # step points of nan/spike: all in reach
                    break
                ranks = targets(spec, st.fired + 1, facts.world, facts.ranks_per_node)
                if not set(ranks) <= facts.ready:
                    break
        return out

    def give_back(self, index: int, point: dict) -> None:
        """A step point of fault `index` whose command its attempt's end overtook (a nan or
        spike sent ahead, its step not reached): due again, into the next attempt."""
        step, t, st = point.get("step"), self.specs[index].trigger, self._state[index]
        if step is None or "save" in point:
            return
        st.spent_steps.discard(int(step))
        if t.kind == "every_steps":
            st.next_index = min(st.next_index, int(step) // t.every_steps - 1)

    def next_time_s(self, index: int) -> float | None:
        """When fault `index` (a time trigger) is next due, if it is; for tests and status."""
        spec, st = self.specs[index], self._state[index]
        return _time_due(spec.trigger, st) if spec.trigger.timed else None


def _point(
    t: Trigger, st: _State, facts: Facts, ahead: int = 0, high: int = 0
) -> tuple[dict, float | None] | None:
    """The trigger's next point if it is due (`ahead`: steps before a step point it is; before
    the attempt's first step, counted from `high`, the newest step of any attempt)."""
    if t.timed:
        due = _time_due(t, st)
        if due is not None and facts.elapsed_s >= due:
            return {"due_s": round(due, 6)}, due
        return None
    if t.kind == "during":
        s = facts.saving
        if s is None or s in st.spent_saves:
            return None
        if t.at_step:
            n = _next_step_point(t, st)
            return ({"save": s, "step": n}, None) if n is not None and s >= n else None
        return ({"save": s}, None) if t.count is None or st.fired < t.count else None
    n = _next_step_point(t, st)
    seen = facts.step if facts.step is not None or not ahead else high
    if n is None or seen is None or seen + ahead < n:
        return None
    if t.after_checkpoint and (facts.ckpt_complete is None or facts.ckpt_complete < n):
        return None
    return {"step": n}, None


def _spend(t: Trigger, st: _State, point: dict, facts: Facts) -> None:
    if t.kind == "at_s":
        st.next_index += 1
    if "save" in point:
        st.spent_saves.add(int(point["save"]))
    if "step" in point:
        st.spent_steps.add(int(point["step"]))
        if t.kind == "every_steps":
            st.next_index = int(point["step"]) // t.every_steps


def _next_step_point(t: Trigger, st: _State) -> int | None:
    if t.kind == "every_steps":  # past those spent (a point given back leaves a gap before them)
        k = st.next_index + 1
        while k * t.every_steps in st.spent_steps:
            k += 1
        return k * t.every_steps
    return next((n for n in t.at_step if n not in st.spent_steps), None)


def _time_due(t: Trigger, st: _State) -> float | None:
    if t.kind == "at_s":
        return t.at_s[st.next_index] if st.next_index < len(t.at_s) else None
    if t.count is not None and st.fired >= t.count:
        return None
    return (st.last_fire_s if st.fired else 0.0) + interval(t, st.fired + 1)


def interval(t: Trigger, n: int) -> float:
    """Seconds between firing n-1 (or the job's start) and firing n of an every_s / mtbf_s
    trigger: a function of the seed and n alone, so a rerun draws the same intervals."""
    rng = random.Random(f"{t.seed}/{t.kind}/{n}")
    if t.kind == "mtbf_s":
        return rng.expovariate(1.0 / t.mtbf_s)
    if t.jitter_s:
        return t.every_s + rng.uniform(-t.jitter_s, t.jitter_s)
    return t.every_s


def targets(spec: FaultSpec, n: int, world: int, ranks_per_node: int) -> tuple[int, ...]:
    """The ranks firing n of a fault hits (a random target is drawn from the seed and n)."""
    tg = spec.target
    if tg.kind == "rank":
        return (tg.index,)
    if tg.kind == "node":
        return tuple(range(tg.nodes[0] * ranks_per_node, (tg.nodes[-1] + 1) * ranks_per_node))
    if tg.kind == "random":
        rng = random.Random(f"{spec.trigger.seed}/{spec.index}/target/{n}")
        return (rng.randrange(world),)
    return tuple(range(world))

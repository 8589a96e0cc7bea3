"""The failure trace of `bench/soak.py`: seeded times and kinds, and the same trace as the
project's `[[faults]]` tables. Pure: no clock, no process; the same seed gives the same trace.

Times are seconds after the run's first step, each `rate_s` x U(0.7, 1.3) after the one before
(drawn from a generator of their own, so `--kills` and `--mixed` of one seed fail at the same
times). Kinds and targets come from a second generator, under two rules that keep a job on its
default config alive through the whole trace: no node gets `exclude_after` failures laid on it
(an excluded node with no spare left ends the job, exit 6), and no more nodes are lost than there
are spares.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

JITTER = 0.3  # each interval is rate_s x U(1 - JITTER, 1 + JITTER)
KILLS = ("kill",)
MIXED = ("kill", "kill_rank", "hang", "stall", "nan", "slow", "node_loss")
# Kinds after which the attempt is over: the next failure waits until the job trains again.
DISRUPTIVE = frozenset({"kill", "kill_rank", "hang", "stall", "node_loss"})
# Kinds a supervisor lays on the target rank's node (faults' target, else the stopped beats).
LAID = frozenset({"kill_rank", "hang", "stall"})
SLOW_DELAY_S = 0.25  # `slow`: seconds added to each step ...
SLOW_DURATION_S = 10.0  # ... for this long

# What each kind is in the project's fault engine (action, and whether it takes a rank).
ACTION = {"kill": "kill", "kill_rank": "kill", "hang": "hang", "stall": "stall", "nan": "nan",
          "slow": "slow", "node_loss": "node_loss"}  # fmt: skip

# How the bench gives each kind to torchrun, which has no channel to a rank but signals.
TORCHRUN_GIVEN = {
    "kill": "SIGKILL of every rank",
    "kill_rank": "SIGKILL of the rank",
    "hang": "SIGSTOP of the rank",
    "stall": "approximated: SIGSTOP of the rank (a rank cannot be told to block inside a step "
    "without the supervisor's control channel; to torchrun both are a rank that stops taking "
    "part, noticed when the others' collective times out at --pg-timeout)",
    "nan": "not given (no channel reaches a rank at a chosen time without the supervisor; the "
    "numerical guard that handles it is the worker's own, the same under either)",
    "slow": f"approximated: the rank SIGSTOPped for {SLOW_DELAY_S:g} s after every step's time, "
    f"for {SLOW_DURATION_S:g} s",
    "node_loss": "approximated: SIGKILL of the node's ranks and their memory-tier slots removed "
    "(torchrun here runs every rank on one host: no node to lose, no spare)",
}


@dataclass(frozen=True)
class Fault:
    """One failure of the trace."""

    index: int
    at_s: float  # seconds after the first step
    kind: str
    target: int | None  # a rank (kill_rank, hang, stall, nan, slow), a node (node_loss)

    @property
    def name(self) -> str:
        """The project's fault name: the bench finds its event and report row by it."""
        return f"soak-{self.index}-{self.kind}"


@dataclass(frozen=True)
class Shape:
    """The job the trace is for: its active nodes, ranks on each, spares."""

    nodes: int
    ranks_per_node: int
    spares: int = 0
    exclude_after: int = 2  # [restart] exclude_after (0: never)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


def times(rate_s: float, duration_s: float, seed: int) -> list[float]:
    """The failure times in (0, duration_s): each rate_s x U(0.7, 1.3) after the one before."""
    rng = random.Random(f"soak/{seed}/times")
    out, t = [], 0.0
    while True:
        t += rate_s * rng.uniform(1 - JITTER, 1 + JITTER)
        if t >= duration_s:
            return out
        out.append(round(t, 3))


def make_trace(
    kinds: Sequence[str], *, rate_s: float, duration_s: float, seed: int, shape: Shape
) -> list[Fault]:
    """The seeded trace: `times`, each with a kind drawn from `kinds` and its target."""
    rng = random.Random(f"soak/{seed}/kinds")
    laid = [0] * shape.nodes  # failures laid on each active node position
    lost = 0
    out = []
    for i, at in enumerate(times(rate_s, duration_s, seed)):
        several = shape.nodes > 1
        room = [n for n in range(shape.nodes) if not _excluded_by(laid[n] + 1, shape)]
        allowed = [
            k
            for k in kinds
            if not (k in LAID and several and not room)
            and not (k == "node_loss" and (not several or lost >= shape.spares))
        ]
        if not allowed:
            continue
        kind = rng.choice(allowed)
        target: int | None = None
        if kind == "node_loss":
            target = rng.randrange(shape.nodes)
            lost += 1
            laid[target] = 0  # a spare in its place: a node with nothing laid on it
        elif kind in LAID and several:
            least = min(laid[n] for n in room)
            node = rng.choice([n for n in room if laid[n] == least])
            laid[node] += 1
            target = node * shape.ranks_per_node + rng.randrange(shape.ranks_per_node)
        elif kind != "kill":
            target = rng.randrange(shape.world)
        out.append(Fault(i, at, kind, target))
    return out


def _excluded_by(count: int, shape: Shape) -> bool:
    return shape.exclude_after > 0 and count >= shape.exclude_after


def project_faults(trace: Sequence[Fault], startup_s: float) -> list[dict]:
    """The trace as `[[faults]]` tables for the project's fault engine: `at_s` counts from the
    job's start, so each is the expected start-up (first step) plus the trace's time."""
    out = []
    for f in trace:
        table: dict = {"name": f.name, "at_s": [round(startup_s + f.at_s, 3)],
                       "action": ACTION[f.kind]}  # fmt: skip
        if f.kind == "kill":
            table["target"] = "all"
        elif f.kind == "node_loss":
            table["target"] = f"node:{f.target}"
        else:
            table["target"] = f"rank:{f.target}"
        if f.kind == "slow":
            table.update(delay_s=SLOW_DELAY_S, duration_s=SLOW_DURATION_S)
        out.append(table)
    return out

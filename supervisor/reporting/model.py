"""What the analysis of a run gives: per-failure rows, node events, checkpoint stalls, the
memory tier's cost, the Young/Daly interval and the totals, as typed dataclasses the report,
the plot, the summary and `status` read."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.reporting.guard_md import GuardRow
from supervisor.reporting.intervals_md import IntervalRow
from supervisor.reporting.lifetimes import Lifetime, Stop
from supervisor.reporting.stragglers_md import StragglerRow


@dataclass
class Failure:
    """One failed attempt and what it cost, up to the run's getting back to where it was."""

    attempt: int
    at_s: float  # failure time on the run's timeline (the fault's, else the best evidence)
    cause: str  # "fault <name>: <action> <target>" or "natural: <detail>"
    detected_by: str  # exit | liveness | progress
    detection_s: float | None  # failure -> the supervisor's teardown began
    step_at_failure: int | None  # the newest step the failed attempt completed
    resumed_from: int | None  # where the next attempt started (None: not relaunched yet)
    lost_steps: int | None
    restart_s: float | None  # the worker's train/restart_seconds after the relaunch
    downtime_s: float | None  # failure -> the first productive step after resume
    recompute_s: float | None  # first productive step -> step_at_failure done again
    fault: bool = False
    relaunch: str | None = None  # warm (a standby took over) | cold | None (not relaunched)
    resumed_source: str | None = None  # memory | partner | durable; None: not said
    # A hang or no progress: where its ranks' stacks went, and a line per rank (state, place).
    stacks_dir: str | None = None
    stacks: list[str] = field(default_factory=list)
    node: str | None = None  # the node the failure was laid on (attempt_end), None: none
    then: list[NodeEvent] = field(default_factory=list)  # what it did to the nodes
    lifetime: int = 1  # the supervisor lifetime of the run dir it happened in (lifetimes.py)

    @property
    def total_s(self) -> float | None:
        if self.downtime_s is None:
            return None
        return self.downtime_s + (self.recompute_s or 0.0)


@dataclass
class NodeEvent:
    """One change to the job's nodes, in the order the supervisor made it: the `start` (active
    and spare), a node excluded, a spare swapped in, a shrink, or the job stopped for want of
    nodes (`give_up` NODES)."""

    kind: str  # start | excluded | swapped | shrink | stop
    at_s: float  # on the run's timeline
    attempt: int | None  # the attempt whose failure made it (None: the start)
    node: str | None = None  # excluded: the node; swapped: the one out
    into: str | None = None  # swapped: the spare that took its place
    count: int | None = None  # excluded: failures laid on the node
    reason: str = ""  # excluded / stop: why
    nodes: list[str] = field(default_factory=list)  # start / shrink: the active nodes after
    spares: list[str] = field(default_factory=list)  # start: the spares; stop: those left
    excluded: list[str] = field(default_factory=list)  # stop: every node out
    world: tuple[int, int] | None = None  # shrink: ranks before, after
    mesh: tuple[str, str] | None = None  # shrink: the parallel layout before, after
    flags: dict[str, Any] = field(default_factory=dict)  # shrink: worker flags overridden
    changes: list[str] = field(default_factory=list)  # shrink: what changed, for people
    batch_kept: bool | None = None  # shrink: the global batch stayed the same
    lifetime: int = 1  # the supervisor lifetime of the run dir that made it

    @property
    def short(self) -> str:
        """A few words for a table cell or a plot label: `excluded n1`, `n1→n3`, …"""
        if self.kind == "excluded":
            return f"excluded {self.node}"
        if self.kind == "swapped":
            return f"{self.node}→{self.into}"
        if self.kind == "shrink":
            return f"shrink to {_count(len(self.nodes), 'node')}"
        if self.kind == "stop":
            return "stopped: too few nodes"
        return f"{_count(len(self.nodes), 'node')}" + (
            f" + {len(self.spares)} spare" if self.spares else ""
        )


@dataclass
class SaveStall:
    """One checkpoint: how long training was blocked for it, and how long until it was marked."""

    step: int
    attempt: int
    save_s: float | None = None  # synchronous save (includes the marker)
    stage_s: float | None = None  # asynchronous: copy to host
    drain_s: float | None = None  # asynchronous: barrier + marker on the main thread
    wait_s: float | None = None  # asynchronous: waiting for the previous save in flight
    marker_s: float | None = None  # save began -> .complete

    @property
    def stall_s(self) -> float:
        parts = (self.save_s, self.stage_s, self.drain_s, self.wait_s)
        return sum(p for p in parts if p is not None)

    @property
    def is_async(self) -> bool:
        return self.save_s is None and self.stage_s is not None

    @property
    def timed(self) -> bool:
        """Whether a later step's record timed it (not the last step's save, nor a stop's)."""
        return self.save_s is not None or self.stage_s is not None


@dataclass
class Checkpoints:
    count: int
    saves: list[SaveStall]
    save_median_s: float | None
    save_max_s: float | None
    stage_median_s: float | None
    stage_max_s: float | None
    drain_median_s: float | None
    drain_max_s: float | None
    stall_median_s: float | None  # per save: sync save, or async stage + drain + wait
    stall_max_s: float | None
    stall_total_s: float
    marker_median_s: float | None
    marker_max_s: float | None


@dataclass
class MemoryTier:
    """What the memory tier cost (`--mem-ckpt-interval`): a copy of each rank's state into
    node-local shared memory. Training waits for the hand-over and for the previous copy (the
    stall); the copy itself runs beside the next step."""

    copies: int
    stall_total_s: float
    stall_median_s: float
    stall_max_s: float
    copy_total_s: float
    copy_median_s: float | None
    copy_max_s: float | None


@dataclass
class Interval:
    """Young/Daly: the checkpoint interval that minimises save cost + expected rework."""

    save_cost_s: float
    mtbf_s: float
    step_s: float  # median step time
    run_interval_steps: int
    young_s: float  # sqrt(2 C M)
    daly_s: float  # sqrt(2 C M) - C (first-order Daly), for C < 2M
    optimal_steps: int
    run_waste: float  # expected fraction lost at the run's interval: C/T + (T + C)/(2M)
    optimal_waste: float
    cost_s: float  # (run_waste - optimal_waste) x wall-clock: what the run's interval cost


@dataclass
class Totals:
    wall_s: float
    finished: bool
    end: str  # supervisor_exit's code name, or "in progress"
    final_step: int | None
    productive_s: float  # train/dt of steps that moved the run forward for the first time
    goodput: float
    startup_s: float | None  # first launch -> first productive step
    restarts: int
    failures: int
    faults: int  # failures caused by an injected fault
    lost_steps: int
    downtime_s: float
    recompute_s: float
    baseline_wall_s: float | None = None
    overhead_s: float | None = None
    overhead_per_failure_s: float | None = None
    reason: str | None = None  # supervisor_exit's reason: why the job ended
    fired: dict[str, int] = field(default_factory=dict)  # `fault` events by action

    @property
    def ended_because(self) -> str | None:
        """Why the job ended, where the code's name alone does not say (the line of the ranks'
        numerical guard when it gave up)."""
        return self.reason if self.end == "DIVERGED" else None


@dataclass
class Analysis:
    run_dir: Path
    name: str
    failures: list[Failure]
    totals: Totals
    checkpoints: Checkpoints
    interval: Interval | None
    curve: list[tuple[float, int, int]]  # (seconds since start, step, attempt) per record
    skipped_lines: int
    save_interval: int | None
    mode: str  # "sync", "async" or "none" (no checkpoints)
    baseline: Analysis | None = None
    notes: list[str] = field(default_factory=list)  # what the run dir lacks
    node_events: list[NodeEvent] = field(default_factory=list)  # the start's first
    memory: MemoryTier | None = None  # None: no memory tier ran
    guard: list[GuardRow] = field(default_factory=list)  # the numerical guard's events
    stragglers: list[StragglerRow] = field(default_factory=list)  # `straggler` events
    intervals: list[IntervalRow] = field(default_factory=list)  # "auto" interval decisions
    lifetimes: list[Lifetime] = field(default_factory=list)  # the supervisors that ran it
    newest: Analysis | None = None  # with several lifetimes: the newest one's own analysis
    # The nodes at the end (active, spares, excluded -> failures laid on it); None: not recorded
    pool: tuple[list[str], list[str], dict[str, int | None]] | None = None

    @property
    def stops(self) -> list[Stop]:
        """The graceful stops the user asked for, a lifetime's end each."""
        return [life.stop for life in self.lifetimes if life.stop is not None]

    @property
    def several(self) -> bool:
        """Whether more than one supervisor ran the job (continued, or run again)."""
        return len(self.lifetimes) > 1

    @property
    def shows_nodes(self) -> bool:
        """Whether nodes are worth a column and a section: more than one node, a spare, or
        anything done to them. A single-node job's report stays as it was."""
        return any(n.kind != "start" or len(n.nodes) > 1 or n.spares for n in self.node_events)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
